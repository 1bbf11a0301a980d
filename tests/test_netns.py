"""A worker behind a real network link that is cut mid-traffic: the worker runs in its own
network namespace joined to this one by a veth pair; the link goes down; the sender's
requests fail with WORKER_FAILED within the configured bound instead of hanging, and the
credits they held come back. Needs root and `ip netns` (skips, saying why, otherwise)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_offload.frames import FrameStatus
from gpu_kernels import reference
from host_client.activations import ActivationError, ActivationSender
from host_client.launcher import AgentProcess

ROOT = Path(__file__).resolve().parents[1]
HOST_IP, NS_IP = "10.213.7.1", "10.213.7.2"  # only on the veth pair this test creates


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def link() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"dpu-{tag}", f"dpuh{tag}", f"dpun{tag}"
    try:
        sh("ip", "netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NS_IP}/30", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_if
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_link_cut_fails_requests_within_the_bound(link: tuple[str, str], qwen_ckpt: Path
                                                  ) -> None:
    ns, host_if = link
    timeout = 2
    with AgentProcess(f'[activations]\nlisten_address = "{HOST_IP}:0"\n'
                      f"worker_timeout_seconds = {timeout}\ncredits_per_sender = 4\n",
                      env={"DPU_AGENT_SERVER_LISTEN_ADDRESS": f"{HOST_IP}:0"}) as agent:
        worker = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "host_client.cli",
             "serve-experts", "--agent", f"{HOST_IP}:{agent.port}", "--checkpoint",
             str(qwen_ckpt), "--model", "nw"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert worker.stdout is not None and worker.stdout.readline().startswith("ready"), \
                worker.stderr.read() if worker.stderr else ""
            rows = reference.f32_to_bf16(np.ones((4, 256), np.float32))
            with ActivationSender(f"{HOST_IP}:{agent.activations_port}", "nw", 6,
                                  credits=4) as sender:
                sender.request(0, 1, rows)  # the link is up: served
                _, out = sender.receive()
                assert out.shape == rows.shape
                sh("ip", "link", "set", host_if, "down")
                started = time.monotonic()
                for e in range(4):  # every credit in flight across the dead link
                    sender.request(0, e, rows)
                failures = []
                for _ in range(4):
                    with pytest.raises(ActivationError) as err:
                        sender.receive()
                    failures.append(err.value.status)
                elapsed = time.monotonic() - started
                # Credits came back, and the dead worker is no longer routed to.
                sender.request(0, 0, rows)
                with pytest.raises(ActivationError) as err:
                    sender.receive()
                assert err.value.status == FrameStatus.NO_ROUTE
            assert failures == [FrameStatus.WORKER_FAILED] * 4
            assert timeout <= elapsed < timeout + 1.5, elapsed
        finally:
            worker.kill()
            worker.wait()
