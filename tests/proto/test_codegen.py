"""The committed generated code is exactly what the .proto files produce (one source of truth)."""

from __future__ import annotations

from pathlib import Path

import pytest

from npuserve.proto import codegen

pytest.importorskip("grpc_tools")


def test_committed_generated_code_matches_the_protos(tmp_path: Path) -> None:
    written = codegen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(codegen.generated_names())
    stale = [
        p.name
        for p in written
        if not (codegen.PROTO_DIR / p.name).is_file()
        or (codegen.PROTO_DIR / p.name).read_text() != p.read_text()
    ]
    assert not stale, f"{stale} differ from the .proto files: run `python -m npuserve.proto.codegen`"


def test_generated_modules_import_inside_the_package() -> None:
    from npuserve.proto import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

    assert executor_pb2.DESCRIPTOR.package == "npuserve.executor.v1"
    assert scheduler_pb2.DESCRIPTOR.package == "npuserve.scheduler.v1"
    # Registered under a namespaced file name, so no other library's `executor.proto` collides.
    assert executor_pb2.DESCRIPTOR.name == "npuserve/proto/executor.proto"
    assert executor_pb2_grpc.ExecutorStub and scheduler_pb2_grpc.SchedulerStub
