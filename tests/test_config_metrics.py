"""Configuration validation, the check-config verb, and a real Prometheus scrape."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpu_agent.config import ConfigError, from_mapping, load
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "agent.toml"


def test_example_config_is_valid_and_documents_every_key() -> None:
    from dpu_agent.config import KEYS

    cfg = load(EXAMPLE, env={})
    assert cfg.arena.bytes == 8 * 2**30 and cfg.transfer.chunk_bytes == 2**20
    text = EXAMPLE.read_text()
    for section, key in KEYS:
        assert f"[{section}]" in text and f"\n{key} =" in text, f"{section}.{key} undocumented"
    # Its header names exactly the settings SIGHUP applies (declared live once, in config.py).
    from dpu_agent.config import LIVE_SETTINGS

    header = text.split("\n\n", 1)[0]
    live = {f"{s}.{k}" for s, k in LIVE_SETTINGS}
    named = set(re.findall(r"\b([a-z_]+\.[a-z_]+)\b", header.split("every other key")[0]))
    assert named == live, (named, live)


def test_every_problem_is_listed_with_its_key() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"server": {"listen_address": "nohost", "bogus": 1},
                      "arena": {"bytes": "lots"},
                      "transfer": {"chunk_bytes": 17, "poll_spin_us": 100_001,
                                   "engine_poll": "sometimes"},
                      "cache": {"policy": "random"}, "weird": 3,
                      "cluster": {"etcd_endpoints": "etcd", "agent_id": "a/b",
                                  "peer_fetch": "sometimes", "lease_seconds": 0}}, env={})
    text = "\n".join(err.value.problems)
    for needle in ("server.listen_address", "server.bogus: unknown key", "arena.bytes",
                   "weird: expected a [weird] table", "cluster.etcd_endpoints: etcd endpoint "
                   "'etcd' is not host:port", "cluster.agent_id", "cluster.peer_fetch",
                   "cluster.lease_seconds: must be positive",
                   "transfer.poll_spin_us: 100001 is not between 0 and 100000",
                   "transfer.engine_poll: 'sometimes' is not one of auto, always, doze"):
        assert needle in text, text


def test_environment_overrides_and_rejects_unknown_variables() -> None:
    cfg = from_mapping({}, env={"DPU_AGENT_ARENA_BYTES": "2GiB"})
    assert cfg.arena.bytes == 2 * 2**30
    with pytest.raises(ConfigError, match="DPU_AGENT_ARENA_SIZE: unknown variable"):
        from_mapping({}, env={"DPU_AGENT_ARENA_SIZE": "1"})


def test_check_config_cli_exit_codes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[arena]\nbytes = -5\n[server]\nlisten_address = "x"\n')
    run = [sys.executable, "-m", "dpu_agent.cli", "check-config"]
    res = subprocess.run([*run, str(bad)], capture_output=True, text=True)
    assert res.returncode == 2 and "arena.bytes" in res.stderr and "server.listen_address" \
        in res.stderr
    res = subprocess.run([*run, str(tmp_path / "missing.toml")], capture_output=True, text=True)
    assert res.returncode == 2 and "no such file" in res.stderr
    good = subprocess.run([*run, str(EXAMPLE)], capture_output=True, text=True)
    assert good.returncode == 0 and good.stdout.startswith(f"configuration OK: {EXAMPLE}")
    # A readable summary: every key under its section, with the value in force.
    assert "\n[transfer]\n" in good.stdout and '\n  engine_poll = "auto"\n' in good.stdout
    assert "\n  bytes = 8589934592  # bytes\n" in good.stdout
    assert "\n  timeout_seconds = 30  # s, live\n" in good.stdout
    assert "AgentConfig(" not in good.stdout


def test_agent_refuses_to_start_on_a_port_in_use() -> None:
    with AgentProcess() as first:
        second = AgentProcess(f'[metrics]\nlisten_address = "127.0.0.1:{first.port}"\n')
        with pytest.raises(RuntimeError, match=r"metrics\.listen_address"):
            second.start()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_metrics_scrape_reflects_activity(agent: AgentProcess, qwen_ckpt: Path) -> None:
    before = scrape(agent.metrics_port)
    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qwen-metrics")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)])
        for e in range(3):
            client.acquire(dev, ExpertKey("qwen-metrics", 2, e)).wait(10)
        during = scrape(agent.metrics_port)
    assert during["dpu_agent_cache_misses_total"] == before["dpu_agent_cache_misses_total"] + 3
    assert during["dpu_agent_sessions"] >= 1
    assert during["dpu_agent_arena_used_bytes"] >= 3 * model.expert_bytes
    assert during["dpu_agent_models_loaded"] >= 1


def test_metrics_families_are_well_formed(agent: AgentProcess) -> None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("dpu_agent_cache_hits", "dpu_agent_cache_misses", "dpu_agent_cache_evictions",
                 "dpu_agent_cache_fill_seconds", "dpu_agent_arena_used_bytes",
                 "dpu_agent_transfers_in_flight", "dpu_agent_placement_copies",
                 "dpu_agent_scheduler_waiting_jobs"):
        assert name in families, name
    assert families["dpu_agent_cache_hits"].type == "counter"
    states = {s.labels["state"] for s in families["dpu_agent_placement_copies"].samples}
    assert states == {"done", "failed", "pending", "dropped"}


def test_grpc_server_metrics_follow_grafana_names(agent: AgentProcess) -> None:
    import grpc

    from dpu_offload.v1 import agent_pb2 as pb
    from dpu_offload.v1 import agent_pb2_grpc as pb_grpc

    with grpc.insecure_channel(agent.address) as ch:
        stub = pb_grpc.DpuAgentStub(ch)
        stub.GetStatus(pb.StatusRequest(), timeout=5)
        with pytest.raises(grpc.RpcError):
            stub.KeepAlive(pb.SessionRef(session_id="nope"), timeout=5)
    samples: list = []

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    # The client sees a status before the server's interceptor has finished counting it.
    deadline = time.monotonic() + 5
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                      timeout=5).read().decode()
        samples[:] = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
        if value("grpc_server_handled_total", grpc_method="KeepAlive") or \
                time.monotonic() > deadline:
            break
        time.sleep(0.05)

    svc = "dpu_offload.v1.DpuAgent"
    assert value("grpc_server_started_total", grpc_service=svc, grpc_method="GetStatus",
                 grpc_type="unary") >= 1
    assert value("grpc_server_handled_total", grpc_service=svc, grpc_method="GetStatus",
                 grpc_code="OK") >= 1
    assert value("grpc_server_handled_total", grpc_service=svc, grpc_method="KeepAlive",
                 grpc_code="NOT_FOUND") >= 1
    assert value("grpc_server_handling_seconds_count", grpc_service=svc,
                 grpc_method="GetStatus") >= 1


APART = ("dpu_agent_cluster_", "dpu_agent_activation_")
"""Metric families an agent exports only when so configured (cluster mode, activations)."""


def dashboard_metrics_missing(metrics_port: int, part: str = "") -> list[str]:
    """Metric names the Grafana dashboard queries that the agent scraped at ``metrics_port``
    does not export: the names that start with ``part`` (one of ``APART``), or, when it is
    empty, every name outside ``APART``."""
    import json
    import re

    dash = json.loads((EXAMPLE.parents[1] / "deploy" / "grafana" / "dpu-agent.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=5).read().decode()
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    exported |= {f.name for f in text_string_to_metric_families(text)}
    functions = {"rate", "sum", "by", "clamp_min", "histogram_quantile", "le"}
    missing = []
    for expr in exprs:
        names = set(re.findall(r"\b([a-z_][a-z0-9_]*)\b(?![({]|\s*\()", re.sub(
            r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]', "", expr))) - functions
        names = {n for n in names if n.startswith(("dpu_agent_", "grpc_server_"))}
        assert names, expr
        mine = [n for n in names
                if (n.startswith(part) if part else not n.startswith(APART))]
        missing += [f"{n} (in {expr!r})" for n in mine if n not in exported]
    return missing


def test_grafana_dashboard_uses_only_exported_metrics(agent: AgentProcess) -> None:
    """The cluster and activation panels are checked against agents so configured
    (tests/test_cluster.py, tests/test_activations.py)."""
    assert dashboard_metrics_missing(agent.metrics_port) == []


def test_promtool_accepts_the_scrape(agent: AgentProcess) -> None:
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read()
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
