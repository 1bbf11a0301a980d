"""Per-call timing of the data path in every process of a benchmark run (client, agent, DMA
engine), opt in: ``python bench/delivery.py --trace DIR`` puts this folder first on
PYTHONPATH and sets ``DPU_TRACE_DIR``, so each Python process started under it imports this
module at start-up, wraps the functions named in ``TARGETS`` once their modules load, and
writes ``DIR/trace-<process>-<pid>.json``: per function, ``[start_ns, wall_ns, cpu_ns]`` of
each call (thread CPU time: a call whose CPU equals its wall time ran, one whose CPU is smaller
waited). ``bench/trace_report.py DIR`` prints the table. Each wrapped call costs about a
microsecond; compare traced runs with traced runs.

A name that no longer exists is listed under ``"missing"`` in the file instead of failing the
process: the table then shows what to update here.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

TARGETS: dict[str, tuple[str, ...]] = {
    "dpu_agent.dataplane.requests": ("RequestServer.serve", "RequestServer._one",
                                     "RequestServer.retry_parked",
                                     "RequestServer._acquire_filling"),
    "dpu_agent.dataplane.plane": ("DataPlane._poll_once",),
    "dpu_agent.dataplane.delivery": ("Deliveries.deliver",),
    "dpu_agent.dataplane.transfers": ("TransferPlan.descriptors", "TransferTracker.complete_many"),
    "dpu_agent.dataplane.queues": ("DeviceQueue.submit",),
    "dpu_agent.dataplane.channels": ("DeviceChannel.take_requests", "DeviceChannel.reply"),
    "dpu_agent.dataplane.grants": ("SlotGrants.acquire", "SlotGrants._reserve"),
    "dpu_agent.weights.cache": ("WeightCache.acquire",),
    "dma_engine.engine": ("Target.serve",),
    "dma_engine.plan": ("Planner.plan",),
    "dma_engine.backends": ("CudaLane.submit", "CpuLane.submit"),
    "host_client.client": ("AgentClient.acquire_batch", "AgentClient._handles",
                           "AgentClient.release_batch", "AgentClient.wait_all"),
    "host_client.handles": ("AcquireHandle._start_check", "AcquireHandle.wait",
                            "AcquireHandle.check_at_post", "AcquireHandle.wait_granted"),
    "host_client.requests": ("ClientChannel.post", "ClientChannel.sleep"),
    "host_client.cuda_device": ("CudaDevice.start_check", "CudaDevice.start_checks"),
}
"""Module -> functions (``Class.method`` or ``function``) whose calls are timed."""
IDLE: dict[str, Callable[[Any], bool]] = {
    "Target.serve": lambda r: r == (0, 0),
    "RequestServer.serve": lambda r: r == 0,
    "RequestServer.retry_parked": lambda r: r == 0,
    "DataPlane._poll_once": lambda r: r == (0, 0),
    "DeviceChannel.take_requests": lambda r: r[1].size == 0,
}
"""Polling functions and how a call that found nothing looks: such calls are not recorded, or
idle polls would bury the work."""
MAX_CALLS = 200_000
DUMP_EVERY_NS = 500_000_000

_calls: dict[str, list[tuple[int, int, int]]] = {}
_missing: list[str] = []
_last_dump = [0]


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    calls = _calls.setdefault(name, [])
    idle = IDLE.get(name, lambda _: False)
    clock, cpu = time.perf_counter_ns, time.thread_time_ns

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = cpu(), clock()
        result = fn(*args, **kwargs)
        t1, c1 = clock(), cpu()
        if not idle(result) and len(calls) < MAX_CALLS:
            calls.append((t0, t1 - t0, c1 - c0))
        if t1 - _last_dump[0] > DUMP_EVERY_NS:
            _last_dump[0] = t1
            dump()
        return result

    return timed


def _patch(module: Any) -> None:
    for path in TARGETS.get(module.__name__, ()):
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name, None) if owner_name else module
        found = None if owner is None else vars(owner).get(attr)
        if found is None:
            _missing.append(f"{module.__name__}.{path}")
        elif isinstance(found, staticmethod):
            setattr(owner, attr, staticmethod(_wrap(path, found.__func__)))
        else:
            setattr(owner, attr, _wrap(path, found))


class _AfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders load a target module, then patches it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module: Any, run: Callable[[Any], None] = run) -> None:
                    run(module)
                    _patch(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def _process_name() -> str:
    argv = sys.orig_argv
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def dump() -> None:
    """Write this process's calls so far (atomically: a reader never sees half a file)."""
    out = os.environ.get("DPU_TRACE_DIR")
    if not out:
        return
    path = os.path.join(out, f"trace-{_process_name()}-{os.getpid()}.json")
    with _lock:
        body = {"calls": {k: list(v) for k, v in list(_calls.items()) if v},
                "missing": list(_missing)}
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


_lock = threading.Lock()


def install(out: str) -> None:
    """Trace this process into ``out`` (and, through the environment, the Python processes it
    starts): target modules loaded later are patched as they load, loaded ones now."""
    os.environ["DPU_TRACE_DIR"] = out
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [here, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    if not any(isinstance(f, _AfterLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoad())
        atexit.register(dump)
        for name in TARGETS:
            if name in sys.modules:
                _patch(sys.modules[name])


if os.environ.get("DPU_TRACE_DIR"):
    install(os.environ["DPU_TRACE_DIR"])
