"""The frontend: input processing, detokenization, the engines users call and the gRPC server (never torch).

``LLM`` and ``LLMEngine`` compose the engine core in this process and so import torch when constructed; the public
names are exported lazily from :mod:`spindle`.
"""
