"""Generated protobuf code is produced from proto/ and must not be stale or hand-edited."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ["agent_pb2.py", "agent_pb2_grpc.py", "agent_pb2.pyi"]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                      f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
                      str(ROOT / "proto/dpu_offload/v1/agent.proto")])
    assert rc == 0
    for name in GENERATED:
        fresh = (tmp_path / "dpu_offload/v1" / name).read_text()
        committed = (ROOT / "dpu_offload/v1" / name).read_text()
        assert fresh == committed, f"dpu_offload/v1/{name} is stale: run `make proto`"
