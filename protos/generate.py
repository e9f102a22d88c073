"""Regenerate the Python stubs of ``protos/`` into ``client/spindle/v1`` with grpcio-tools (``make protos``).

The proto package ``spindle.v1`` is also the Python package the stubs live in (in the spindle-client distribution),
so protoc's own imports (``from spindle.v1 import spindle_pb2``) are right as generated.

    python protos/generate.py [OUT_ROOT]     # OUT_ROOT defaults to client/: the committed stubs
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"
OUT_ROOT = REPO / "client"


def generate(out_root: Path = OUT_ROOT) -> list[Path]:
    """Compile every ``.proto`` under ``protos/`` into ``out_root``; returns the files written.

    Raises:
        RuntimeError: protoc reported an error.

    """
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # the well-known types shipped with grpcio-tools
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}"]
    args += [f"--grpc_python_out={out_root}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[str(p) for p in protos]}")
    stems = [out_root / proto.relative_to(PROTO_ROOT).with_suffix("") for proto in protos]
    return [stem.with_name(stem.name + suffix) for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


if __name__ == "__main__":
    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_ROOT
    for path in generate(out_root):
        print(path)
