"""Regenerate the Python stubs of ``protos/`` into this package with grpcio-tools (``make protos``).

The generated ``*_pb2_grpc.py`` import their messages as top-level ``spindle.v1``; the import is rewritten to
``frontend.protos.spindle.v1`` so that the stubs live inside the ``frontend`` package.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PACKAGE = "frontend.protos"
OUT_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Compile every ``.proto`` under ``protos/`` into ``out_dir``; returns the files written.

    Raises:
        RuntimeError: protoc reported an error.

    """
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # the well-known types shipped with grpcio-tools
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    args += [f"--grpc_python_out={out_dir}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[str(p) for p in protos]}")
    written = []
    for proto in protos:
        stem = out_dir / proto.relative_to(PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = stem.with_name(stem.name + suffix)
            source = path.read_text()
            for package in {p.relative_to(PROTO_ROOT).parent.as_posix().replace("/", ".") for p in protos}:
                source = source.replace(f"from {package} import", f"from {PACKAGE}.{package} import")
            path.write_text(source)
            written.append(path)
    return written


def main() -> None:
    """Regenerate the stubs in place and list them."""
    for path in generate():
        print(path.relative_to(REPO))


if __name__ == "__main__":
    sys.exit(main())
