"""The OpenAI-compatible HTTP API (``spindle serve --http-port``), served beside gRPC on the frontend's event loop.

The request and response shapes, the routes over the gRPC server's servicer, and the server's life.
"""
