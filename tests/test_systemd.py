"""The unit file passes systemd's own checks, and the daemon speaks sd_notify in order: READY
only once serving, watchdog pings, RELOADING/READY around SIGHUP, STOPPING on SIGTERM; SIGUSR1
writes every thread's stack to its log and changes nothing."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "dpu-agent.service"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed "
                                   "(Debian package systemd)")


def _unit_with_local_binary(tmp_path: Path) -> Path:
    exe = Path(sys.executable).with_name("dpu-agent")
    unit = tmp_path / "dpu-agent.service"
    unit.write_text(UNIT.read_text().replace("/opt/dpu-agent/bin/dpu-agent", str(exe)))
    return unit


@needs_analyze
def test_unit_verifies_clean(tmp_path: Path) -> None:
    res = subprocess.run([ANALYZE, "verify", str(_unit_with_local_binary(tmp_path))],
                         capture_output=True, text=True)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr


@needs_analyze
def test_unit_security_exposure_at_most_2(tmp_path: Path) -> None:
    res = subprocess.run([ANALYZE, "security", "--offline=true",
                          str(_unit_with_local_binary(tmp_path))], capture_output=True,
                         text=True)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout)
    assert m, res.stdout[-500:] + res.stderr
    assert float(m[1]) <= 2.0, res.stdout[-2000:]


class NotifyListener:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def collect_until(self, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.messages.extend(self.sock.recv(4096).decode().splitlines())
            except TimeoutError:
                pass
            if predicate(self.messages):
                return
        raise AssertionError(f"timed out; got {self.messages}")


def _spawn(tmp_path: Path, config: str, notify: Path) -> subprocess.Popen[bytes]:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(config)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "300000"}
    return subprocess.Popen([sys.executable, "-m", "dpu_agent.cli", "serve", "--config",
                             str(cfg)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def test_notify_sequence_ready_watchdog_reload_stopping(tmp_path: Path) -> None:
    listener = NotifyListener(tmp_path / "notify")
    base = '[server]\nlisten_address = "127.0.0.1:0"\n[arena]\nbytes = "8MiB"\n'
    proc = _spawn(tmp_path, base, tmp_path / "notify")
    try:
        listener.collect_until(lambda m: m.count("WATCHDOG=1") >= 2, 20)
        first = listener.messages.index("READY=1")
        assert first < listener.messages.index("WATCHDOG=1")
        assert any(m.startswith("STATUS=serving on port") for m in listener.messages)
        (tmp_path / "agent.toml").write_text(base + "[transfer]\ntimeout_seconds = 5\n")
        proc.send_signal(signal.SIGHUP)
        listener.collect_until(lambda m: "RELOADING=1" in m and
                               m.index("RELOADING=1") < len(m) - 1 and
                               "READY=1" in m[m.index("RELOADING=1"):], 10)
        pings = listener.messages.count("WATCHDOG=1")
        proc.send_signal(signal.SIGUSR1)  # every thread's stack, and it serves on
        listener.collect_until(lambda m: m.count("WATCHDOG=1") >= pings + 2, 10)
        proc.send_signal(signal.SIGTERM)
        listener.collect_until(lambda m: "STOPPING=1" in m, 10)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode()
    assert "transfer.timeout_seconds: 30 -> 5" in out, out
    assert re.search(r"Thread 0x[0-9a-f]+ .*\(most recent call first\):\n  File ", out), out


def test_bad_config_never_sends_ready(tmp_path: Path) -> None:
    listener = NotifyListener(tmp_path / "notify")
    proc = _spawn(tmp_path, '[server]\nlisten_address = "nope"\n[bogus]\nx = 1\n',
                  tmp_path / "notify")
    assert proc.wait(20) == 2
    out = proc.stdout.read().decode()
    assert "server.listen_address" in out and "bogus" in out
    with pytest.raises(AssertionError):
        listener.collect_until(lambda m: "READY=1" in m, 0.5)


def test_json_logs_carry_request_ids(tmp_path: Path) -> None:
    import json

    from host_client import AgentClient
    from host_client.launcher import AgentProcess

    with AgentProcess(env={"DPU_AGENT_LOGGING_FORMAT": "json"}) as agent:
        with AgentClient(agent.address, client_name="log-test"):
            pass
        time.sleep(0.2)
        lines = [json.loads(x) for x in agent.log().splitlines() if x.startswith("{")]
    opened = [x for x in lines if x.get("client") == "log-test"]
    assert opened and opened[0]["request_id"] != "-" and opened[0]["level"] == "INFO"
    assert all({"ts", "level", "logger", "msg", "request_id"} <= set(x) for x in lines)


def test_sigterm_drains_then_cancels_and_exits_zero(qwen_ckpt: Path) -> None:
    from dpu_offload.keys import ExpertKey
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec, TransferFailed
    from host_client.errors import AgentUnavailable
    from host_client.launcher import AgentProcess

    agent = AgentProcess("[server]\ndrain_grace_seconds = 1\n").start()
    client = AgentClient(agent.address)
    try:
        model = client.load_model(str(qwen_ckpt), "drain")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        dev.device.stop()  # nothing will complete: the transfer stays in flight
        (handle,) = client.acquire_batch(dev, [ExpertKey("drain", 0, 0)])  # once granted
        t0 = time.monotonic()
        assert agent.stop(timeout=15) == 0
        assert 0.9 < time.monotonic() - t0 < 10, "did not wait out the grace, or hung"
        with pytest.raises((TransferFailed, AgentUnavailable)):
            handle.wait(5)
    finally:
        client.close()
        agent.kill()
    assert "cancelled 1 transfers still in flight" in agent.log()
