"""x86 host client <-> aarch64 agent: the end-to-end checks that matter across the pair."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint, read_tensor_bytes
from host_client.launcher import AgentProcess
from tests.arm64.conftest import STARTUP_SECONDS, arm64_env, arm64_interpreter

# pytest-timeout counts the module fixture's start-up into the first test that uses it.
pytestmark = [pytest.mark.arm64, pytest.mark.timeout(STARTUP_SECONDS + 180)]


def test_interpreter_is_really_aarch64() -> None:
    out = subprocess.run([*arm64_interpreter(), "-c", "import platform;print(platform.machine())"],
                         capture_output=True, text=True, env=arm64_env(), check=True).stdout
    assert out.strip() == "aarch64"


def test_session_model_acquire_bytes_events(arm_agent: AgentProcess, tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ds", CheckpointSpec("deepseek-v3", layers=3, experts=4,
                                                           dtype="fp8", hidden=256,
                                                           intermediate=256))
    truth = read_tensor_bytes(root)
    with AgentClient(arm_agent.address, client_name="x86-host", rpc_timeout=120) as client:
        model = client.load_model(str(root), "arm-ds")
        assert model.architecture == "deepseek_v3" and list(model.moe_layers) == [1, 2]
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes,
                                                                          8)])
        keys = [ExpertKey("arm-ds", layer, e) for layer in (1, 2) for e in range(4)]
        slots = [h.wait(120) for h in client.acquire_batch(dev, keys)]  # completions: events
        for slot in slots:
            for role in ("gate_proj", "down_proj_scale_inv"):
                base = role.removesuffix("_scale_inv")
                suffix = "weight_scale_inv" if role.endswith("_inv") else "weight"
                k = slot.key
                name = f"model.layers.{k.layer}.mlp.experts.{k.expert}.{base}.{suffix}"
                assert slot.raw(role).tobytes() == truth[name], (slot.key, role)
        assert client.status().experts_cached == 8


def test_health_and_metrics(arm_agent: AgentProcess) -> None:
    with grpc.insecure_channel(arm_agent.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    text = urllib.request.urlopen(f"http://127.0.0.1:{arm_agent.metrics_port}/metrics",
                                  timeout=30).read().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"dpu_agent_cache_misses", "grpc_server_handled"} <= names


def test_graceful_sigterm_exits_zero() -> None:
    agent = AgentProcess(env=arm64_env(), interpreter=arm64_interpreter(),
                         startup_timeout=STARTUP_SECONDS)
    agent.start()
    with AgentClient(agent.address, rpc_timeout=60) as client:
        assert client.status().version
    assert agent.stop(timeout=60) == 0
