"""The gRPC server that serves ``AsyncLLMEngine``.

Its settings and flags, the proto mapping, the servicer, admission control, the server's life, and its load figures,
metrics and trace spans.
"""
