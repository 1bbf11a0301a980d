"""Where a delivery's time goes, seen from the client (bench/delivery.py): a cold acquire's
stages, a batch's per-expert timeline, and the agent's own request timings from its metrics.
The client spins on shared memory here (it never sleeps), so these runs time the system, not
the client's wake-ups."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.common import median
from dpu_offload import abi
from dpu_offload.channel import split_word
from dpu_offload.keys import ExpertKey
from host_client import AcquireHandle, AgentClient

_LANDED_OR_AFTER = (abi.SlotState.LANDED, abi.SlotState.READY, abi.SlotState.FAILED)
_ENDED = (abi.SlotState.READY, abi.SlotState.FAILED)


def _stage(channel: Any, handle: AcquireHandle) -> tuple[bool, bool]:
    """(landed, ended) for a granted handle's slot as its word reads now: the engine's bytes
    are in (LANDED or later), and the check's verdict is out (READY or FAILED); a slot that
    moved on to a newer generation counts as both."""
    index = int(handle._reply["state_index"])
    mine = int(handle._reply["generation"])
    generation, state = split_word(channel.word(index))
    if generation > mine:
        return True, True
    return (generation == mine and state in _LANDED_OR_AFTER,
            generation == mine and state in _ENDED)


def stage_breakdown(client: AgentClient, dev: Any, cold: list[ExpertKey],
                    resident: list[ExpertKey], samples: int,
                    cycle: Callable[[list[ExpertKey]], float]) -> dict[str, float]:
    """Where a cold acquire's time goes (p50 ms from the post): the agent's reply
    (``grant``), the slot's word reading LANDED (a DMA-engine device: the engine's bytes are
    in) or READY, and the verdict (``ready``, the check included)."""
    grant, landed, ready = [], [], []
    for r in range(samples):
        k = cold[r % len(cold)]
        t0 = time.perf_counter()
        handle = client.acquire(dev, k)
        while not handle.granted():
            pass
        t1 = time.perf_counter()
        if handle.refusal is not None:
            raise handle.refusal
        while not _stage(dev.channel, handle)[0]:
            time.sleep(0)  # yields the GIL: a CPU device's check runs in this process
        t2 = time.perf_counter()
        handle.wait(60)
        t3 = time.perf_counter()
        grant.append(t1 - t0)
        landed.append(t2 - t0)
        ready.append(t3 - t0)
        client.release(dev, k)
        cycle(resident)
    return {"stage_grant_p50_ms": median(grant) * 1e3,
            "stage_landed_p50_ms": median(landed) * 1e3,
            "stage_ready_p50_ms": median(ready) * 1e3}


def batch_timeline(client: AgentClient, dev: Any, batches: tuple[list[ExpertKey], ...],
                   samples: int, timeout: float = 60.0) -> dict[str, list[float]]:
    """Each expert's stages in a batch of cold acquires posted together
    (``acquire_batch(wait=False)``, the batches taken in turn so each evicts the last): when
    the agent's grant, the engine's LANDED and the verdict were first seen, in ms from the
    post, p50 over ``samples`` batches per position in the batch (``grant``, ``landed``,
    ``ready``: ``float[len(batch)]`` each), and ``end``: ``[p50 ms]`` of the batch's last
    verdict."""
    seen: dict[str, list[list[float]]] = {"grant": [], "landed": [], "ready": []}
    ends = []
    for r in range(samples):
        batch = batches[r % len(batches)]
        t0 = time.perf_counter()
        handles = client.acquire_batch(dev, batch, wait=False)
        n = len(handles)
        at: dict[str, list[float | None]] = {k: [None] * n for k in seen}
        deadline = t0 + timeout
        while None in at["ready"]:
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"batch timeline: no verdict within {timeout} s")
            for i, h in enumerate(handles):
                if at["ready"][i] is not None:
                    continue
                if at["grant"][i] is None:
                    if not h.granted():
                        continue
                    if h.refusal is not None:
                        raise h.refusal
                    at["grant"][i] = now - t0
                landed, ended = _stage(dev.channel, h)
                if landed and at["landed"][i] is None:
                    at["landed"][i] = now - t0
                if ended:
                    at["ready"][i] = now - t0
            time.sleep(0)  # yields the GIL: a CPU device's check runs in this process
        client.wait_all(handles, timeout)
        client.release_batch(dev, batch)
        for k in seen:
            seen[k].append([float(x) for x in at[k]])  # type: ignore[arg-type]
        ends.append(max(at["ready"]))  # type: ignore[type-var]
    out = {k: [median([s[i] for s in v]) * 1e3 for i in range(len(v[0]))]
           for k, v in seen.items()}
    out["end"] = [median(ends) * 1e3]
    return out


def agent_request_times(before: dict[str, float], after: dict[str, float]
                        ) -> dict[str, float]:
    """Mean microseconds a request waited in its ring before the agent's loop took it, and
    the agent took to serve it, between two scrapes of the agent's metrics."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    n = delta("dpu_agent_dataplane_timed_requests_total")
    if not n:
        return {}
    return {"agent_request_wait_us": delta("dpu_agent_dataplane_request_wait_seconds_total")
            / n * 1e6,
            "agent_request_service_us":
            delta("dpu_agent_dataplane_request_service_seconds_total") / n * 1e6}
