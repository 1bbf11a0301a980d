"""Which CPUs a process runs on: the emulated DPU's processes on cores of their own, the
inference process off them (``[process] cpus``, ``DPU_AGENT_PROCESS_CPUS``)."""

from __future__ import annotations

import os
from collections.abc import Collection


def run_on(cpus: Collection[int]) -> None:
    """Every thread of this process so far (an import may have started one) on ``cpus``; the
    threads and processes it starts later inherit it. OSError where ``cpus`` lies outside the
    cpuset the process was started in."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)
