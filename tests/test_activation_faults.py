"""The activation path's faults: packets corrupted or delivered short on the wire (caught,
delivered again, counted), a worker that vanishes or an agent that stops answering (bounded
failures), and the NIC stand-in killed (restarted on its port with its workers)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from dpu_offload.frames import FrameStatus
from gpu_kernels import packet_twin, reference
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationError, ActivationSender
from host_client.launcher import AgentProcess
from host_client.worker import ExpertWorker
from nic.nic import PACKET_RETRIES
from tests.activation_serving import SETTINGS, dispatch_matches_dense, metrics, routing, serving


class WireFaultWorker(ExpertWorker):
    """A worker whose rx ring has the last packet of each of its next ``bad`` parts spoiled
    (:meth:`spoil`) before the receiver reads it: a wire or NIC fault."""

    bad = 0

    def spoil(self, rx, i: int) -> None:
        raise NotImplementedError

    def _land(self, dst):
        rx = self.dev.rx.ring
        n = packet_twin.part_packets(rx)
        if n is not None and self.bad > 0:
            self.bad -= 1
            self.spoil(rx, (rx.consumed + n - 1) % rx.capacity)
        return super()._land(dst)


class FlakyRxWorker(WireFaultWorker):
    """One payload byte of the packet corrupted."""

    def spoil(self, rx, i: int) -> None:
        rx.payload[i, 0] ^= 0xFF


def retransmits(agent: AgentProcess) -> float:
    return metrics(agent)[("dpu_agent_activation_retransmits_total", ())]


def test_corrupted_packets_are_caught_delivered_again_and_counted(qwen_ckpt: Path) -> None:
    from prometheus_client import REGISTRY

    def refused(device: int) -> float:
        return REGISTRY.get_sample_value("dpu_worker_packets_refused_total",
                                         {"device": str(device)}) or 0.0

    with serving(qwen_ckpt, FlakyRxWorker) as (agent, _, model, devs, worker):
        dev = devs[0].device_id
        before = refused(dev)
        worker.bad = 2  # the first request's part fails twice, then arrives intact
        ids = routing(model.experts_per_layer, 8, 1, seed=3)
        dispatch_matches_dense(f"127.0.0.1:{agent.activations_port}", "qa",
                               model.experts_per_layer, model.moe_layers[0], qwen_ckpt, ids)
        assert worker.refused_packets == 2 and retransmits(agent) == 2
        assert refused(dev) - before == 2
        # A part that never arrives intact fails its request with a clear status; the sender's
        # credit comes back and the next request is served.
        worker.bad = 10**6
        x = reference.f32_to_bf16(np.ones((1, 256), np.float32))
        with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qa",
                              model.experts_per_layer, credits=1) as sender:
            with pytest.raises(ActivationError) as err:
                sender.dispatch(model.moe_layers[0], x, np.array([[0]]),
                                np.ones((1, 1), np.float32))
            assert err.value.status == FrameStatus.WORKER_FAILED
            assert "failed their checksum" in str(err.value)
            assert f"{PACKET_RETRIES + 1} times" in str(err.value)
            worker.bad = 0
            sender.dispatch(model.moe_layers[0], x, np.array([[0]]), np.ones((1, 1), np.float32))
        assert retransmits(agent) == 2 + PACKET_RETRIES


class EmptyingRxWorker(WireFaultWorker):
    """The first part's last packet rewritten as a valid empty one (length 0, checksum 0: the
    checksum of no bytes): nothing is refused, bytes are missing (found by the request-ring's
    fuzz of the packet twin)."""

    bad = 1

    def spoil(self, rx, i: int) -> None:
        rx.entries[i:i + 1]["length"] = 0
        rx.entries[i:i + 1]["checksum"] = 0


def test_a_part_delivered_short_is_delivered_again(qwen_ckpt: Path) -> None:
    with serving(qwen_ckpt, EmptyingRxWorker) as (agent, _, model, _, worker):
        dispatch_matches_dense(f"127.0.0.1:{agent.activations_port}", "qa",
                               model.experts_per_layer, model.moe_layers[0], qwen_ckpt,
                               routing(model.experts_per_layer, 8, 1, seed=5))
        assert worker.bad == 0 and retransmits(agent) == 1 and worker.refused_packets == 0


def test_worker_vanishing_mid_request_fails_within_bound(qwen_ckpt: Path) -> None:
    settings = SETTINGS + "worker_timeout_seconds = 1\n"
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qv")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 18)])
        client.wait_placement(client.apply_placement(
            "qv", [[[dev.device_id]] * 6 for _ in model.moe_layers]).placement_id)
        worker = ExpertWorker(client, dev)
        worker._stop.set()          # the worker process "dies": its rings stay silent
        worker._thread.join()
        with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qv", 6) as s:
            t0 = time.monotonic()
            s.request(model.moe_layers[0], 1, np.zeros((2, 256), np.uint16))
            with pytest.raises(ActivationError) as err:
                s.receive()
            assert err.value.status == FrameStatus.WORKER_FAILED
            assert time.monotonic() - t0 < 3
            # The dead worker is no longer a route.
            s.request(model.moe_layers[0], 1, np.zeros((2, 256), np.uint16))
            with pytest.raises(ActivationError) as err:
                s.receive()
            assert err.value.status == FrameStatus.NO_ROUTE


def test_a_worker_stops_within_its_bound_when_the_agent_does_not_answer(
        qwen_ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    from host_client import worker as worker_module

    with serving(qwen_ckpt) as (agent, _client, _model, _devs, worker):
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGSTOP)  # alive, answering nothing
        try:
            t0 = time.monotonic()
            worker.close()
            took = time.monotonic() - t0
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
        assert took < worker_module.STOP_SECONDS + 3, took
        assert "was not told to stop serving it: StatusCode.DEADLINE_EXCEEDED" in caplog.text


def test_a_killed_nic_is_restarted_on_its_port_with_its_workers(qwen_ckpt: Path) -> None:
    """The NIC stand-in SIGKILLed: the agent notices within its liveness sweep (0.5 s) and
    starts a new one on the same port with every worker's rings attached again; the next
    requests are served as before, through the same address, by the same worker."""
    import os
    import signal as sig

    from bench.common import child_pid

    with serving(qwen_ckpt) as (agent, _, model, _, worker):
        address = f"127.0.0.1:{agent.activations_port}"
        layer = model.moe_layers[0]
        ids = routing(model.experts_per_layer, 8, 1, seed=9)
        dispatch_matches_dense(address, "qa", model.experts_per_layer, layer, qwen_ckpt, ids)
        old = child_pid(agent.proc.pid, "nic")
        assert old
        os.kill(old, sig.SIGKILL)
        deadline = time.monotonic() + 5
        while child_pid(agent.proc.pid, "nic") in (0, old):
            assert time.monotonic() < deadline, "the NIC was not restarted"
            time.sleep(0.05)
        served = worker.served
        dispatch_matches_dense(address, "qa", model.experts_per_layer, layer, qwen_ckpt, ids)
        assert worker.served > served  # the same worker, re-attached, served them
        assert agent.proc.poll() is None
