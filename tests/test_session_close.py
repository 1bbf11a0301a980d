"""A client's close against its own recovery: the session ended by another caller while the
client closes must leave nothing behind, whichever comes first."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess


def sessions(agent: AgentProcess) -> float:
    """The agent's ``dpu_agent_sessions`` gauge."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "dpu_agent_sessions")


def test_a_close_during_a_recovery_waits_for_it_and_leaves_no_session(
        agent: AgentProcess, qwen_ckpt: Path) -> None:
    """The session is ended by another call (its event stream ends, so the client recovers:
    a new session, its device registered again) and the client closes while that restore is
    under way: the close waits for the restore, then ends the new session and releases the
    device. Nothing raises, and the agent is left with no session of this client. A close
    that ran beside the restore cut it short (its calls refused NOT_FOUND), and once freed
    the device's memory while the restore was making it ("dictionary changed size during
    iteration" in a full suite's run of test_engine_control)."""
    restoring = threading.Event()

    class SlowDevice(CpuReferenceDevice):
        """Its memory made slowly once the client is restoring: the close comes meanwhile."""

        def allocate(self, nbytes: int, shared: str = ""):
            if restoring.is_set():
                time.sleep(0.5)
            return super().allocate(nbytes, shared)

    class Restoring(AgentClient):
        def _restore(self) -> None:
            restoring.set()
            super()._restore()

    before = sessions(agent)
    client = Restoring(agent.address)
    model = client.load_model(str(qwen_ckpt), "qwen-close")
    device = SlowDevice(7)
    client.register_device(device, [SlotPoolSpec(model.expert_bytes, 2)], delivery="engine")
    first = client.session_id
    client.stub.CloseSession(pb.SessionRef(session_id=first), timeout=5)
    assert restoring.wait(10), "the client did not recover"
    time.sleep(0.1)  # the restore is making the device's memory
    client.close()
    assert client.reconnected.is_set()  # the restore ran to its end, not cut by the close
    assert client.session_id != first  # the restored session is the one the close ended
    assert device.memory == {} and device._shared == {}  # nothing made after the release
    deadline = time.monotonic() + 5
    while sessions(agent) != before:
        assert time.monotonic() < deadline, f"{sessions(agent) - before} sessions left open"
        time.sleep(0.05)
