"""The frontend: request processing, the engines users call and their clients, and the gRPC server (never torch).

``processing`` checks and tokenizes prompts and turns the engine core's deltas into outputs; ``engine`` holds
``LLM``, ``LLMEngine`` and ``AsyncLLMEngine``, the one admission path their requests take and the engine clients that
reach the engine core (in this process, in a backend process, or in several); ``grpc`` serves ``AsyncLLMEngine``
over gRPC. ``LLM`` and ``LLMEngine`` compose the engine core in this process by default and so import torch when
constructed; the public names are exported lazily from :mod:`spindle`.
"""
