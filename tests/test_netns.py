"""A sender behind a real network link that is cut mid-traffic. The sender (an attention node)
runs in its own network namespace joined to this one by a veth pair; its requests are at the
NIC stand-in and being served when the link goes down: the sender's wait ends with its own
timeout instead of hanging, the NIC's credits for it come back as the worker answers into the
dead link, and the NIC keeps serving everyone else. (Worker and NIC share the host: their rings
are shared memory, the PCIe path, not a network link.) Needs root and `ip netns` (skips,
saying why, otherwise)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_kernels import reference
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationSender
from host_client.launcher import AgentProcess
from host_client.worker import ExpertWorker
from tests.conftest import child_env

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


SENDER = """
import sys, time
import numpy as np
from host_client.activations import ActivationSender
with ActivationSender(sys.argv[1], "nw", 6, credits=4, timeout=float(sys.argv[2])) as s:
    for e in range(4):
        s.request(0, e, np.ones((4, 256), np.uint16))
    print("sent", flush=True)
    sys.stdin.readline()  # the link is cut now
    t0 = time.monotonic()
    try:
        s.receive()
        print("answered", flush=True)
    except TimeoutError:
        print(f"timed out after {time.monotonic() - t0:.2f}", flush=True)
"""


class GatedWorker(ExpertWorker):
    """A worker that serves nothing until ``gate`` opens."""

    gate = threading.Event()

    def _take(self, h):
        self.gate.wait()
        return super()._take(h)


def outstanding(agent: AgentProcess) -> float:
    text = urllib.request.urlopen(f"http://{HOST_IP}:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "dpu_agent_activation_outstanding")


def test_a_cut_sender_times_out_and_the_nic_serves_on(link: tuple[str, str],
                                                      qwen_ckpt: Path) -> None:
    ns, host_if = link
    timeout = 2.0
    settings = (f'[activations]\nlisten_address = "{HOST_IP}:0"\ncredits_per_sender = 4\n'
                f'[metrics]\nlisten_address = "{HOST_IP}:0"\n')
    with AgentProcess(settings, env={"DPU_AGENT_SERVER_LISTEN_ADDRESS": f"{HOST_IP}:0"}
                      ) as agent, AgentClient(f"{HOST_IP}:{agent.port}") as client:
        model = client.load_model(str(qwen_ckpt), "nw")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 18)])
        client.wait_placement(client.apply_placement(
            "nw", [[[dev.device_id]] * 6 for _ in model.moe_layers]).placement_id)
        GatedWorker.gate.clear()
        worker = GatedWorker(client, dev)
        address = f"{HOST_IP}:{agent.activations_port}"
        sender = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", SENDER, address, str(timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=child_env())
        try:
            assert sender.stdout is not None and sender.stdin is not None
            assert sender.stdout.readline().strip() == "sent", sender.stderr
            deadline = time.monotonic() + 10
            while outstanding(agent) < 4:  # all four are at the NIC, waiting for the worker
                assert time.monotonic() < deadline, "the requests never reached the NIC"
                time.sleep(0.05)
            sh("ip", "link", "set", host_if, "down")
            sender.stdin.write("\n")
            sender.stdin.flush()
            GatedWorker.gate.set()  # answers go into the dead link
            line = sender.stdout.readline().strip()
            assert line.startswith("timed out after"), line
            assert timeout <= float(line.rsplit(" ", 1)[1]) < timeout + 1.5, line
            deadline = time.monotonic() + 5
            while outstanding(agent):  # the NIC took its credits back as the answers left
                assert time.monotonic() < deadline, "the NIC kept the cut sender's requests"
                time.sleep(0.05)
            with ActivationSender(address, "nw", 6, credits=4) as local:
                rows = reference.f32_to_bf16(np.ones((4, 256), np.float32))
                local.request(model.moe_layers[0], 1, rows)
                assert local.receive()[1].shape == rows.shape
            assert worker.served == 5
        finally:
            GatedWorker.gate.set()
            sender.kill()
            sender.wait()
            worker.close()
