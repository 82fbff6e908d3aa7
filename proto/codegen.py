"""Generates the Python protobuf and gRPC code for the .proto files of this folder.

`python -m npuserve.proto.codegen` refreshes the committed `*_pb2.py`, `*_pb2.pyi` and
`*_pb2_grpc.py` files next to this module; a test regenerates into a temporary folder and fails
when they differ, so the .proto files stay the one source of truth. grpc_tools is a test/dev
dependency and is imported only when code is generated.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("executor.proto", "scheduler.proto")
# NOTE: protoc sees the files under this virtual path, so the names registered in protobuf's
# process-wide descriptor pool are `npuserve/proto/executor.proto` rather than a bare
# `executor.proto` that another library could also register.
VIRTUAL_DIR = "npuserve/proto"
_ABSOLUTE_IMPORT = re.compile(r"^from npuserve\.proto import (\w+_pb2)", re.MULTILINE)


def generated_names() -> list[str]:
    """The file names `generate` writes, in a stable order."""
    stems = [Path(name).stem for name in PROTO_FILES]
    return [f"{stem}{suffix}" for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def generate(out_dir: Path) -> list[Path]:
    """Writes the generated code for every .proto file into `out_dir`; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _run_protoc(Path(tmp))
        produced = Path(tmp) / VIRTUAL_DIR
        written = []
        for name in generated_names():
            target = out_dir / name
            # `from npuserve.proto import x_pb2` -> `from . import x_pb2`: independent of the install name.
            target.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1", (produced / name).read_text()))
            written.append(target)
    return written


def _run_protoc(out: Path) -> None:
    from grpc_tools import protoc

    includes = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_DIR}={PROTO_DIR}",
        f"-I{includes}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(f"{VIRTUAL_DIR}/{name}" for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)} (its errors are printed above)")


if __name__ == "__main__":
    for path in generate(PROTO_DIR):
        print(f"wrote {path}")
