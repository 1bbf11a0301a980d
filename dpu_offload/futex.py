"""Sleeping on a word of shared memory until another process changes it (Linux futexes on a
``MAP_SHARED`` mapping): how a waiter for a slot-state word or a reply spends no CPU, and how the
agent wakes it after publishing. The low 32 bits of a 64-bit little-endian word are the futex
word. Elsewhere than Linux, ``wait`` naps ``timeout`` and ``wake`` does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time

SPARE_CORES = (os.cpu_count() or 1) >= 8
"""Whether this machine has cores to spare for polling (8 CPUs or more): there the processes
that stand for hardware (the NIC stand-in, the DMA engine) and an expert worker's receiver poll
a while after work instead of sleeping at once; on a small machine (CI's 2 cores) a poller
starves the very process it waits for."""
SPARE_CORE_SPIN_SECONDS = 0.002 if SPARE_CORES else 0.0
"""How long those pollers keep polling after work (or a request) before they sleep."""

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: no FUTEX_PRIVATE_FLAG
_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_syscall = _libc.syscall if _libc is not None and _SYS_FUTEX is not None else None
"""Releases the GIL (a wait blocks)."""
_syscall_held = (ctypes.PyDLL(None).syscall if _syscall is not None else None)
"""Keeps the GIL: a wake never blocks, and giving the GIL up costs the waker the time another
thread of its process holds it (measured ~100 us per wake in the agent)."""


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleep until the 32-bit word at ``address`` may differ from ``expected`` (its low 32
    bits), a wake, or ``timeout`` seconds; returns at once if it differs already."""
    if _syscall is None:
        time.sleep(timeout)
        return
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT,
             ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)


def tight_timer_slack(name: str = "") -> None:
    """Ask Linux for 1 us timer slack on the calling thread (default 50 us), so that the short
    naps of a polling loop are short; ``name`` (15 bytes at most) becomes the thread's name in
    the kernel (``top -H``, ``/proc/PID/task/TID/comm``)."""
    if _libc is not None:
        _libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns
        if name:
            _libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


def wake(address: int) -> None:
    """Wake every process sleeping on the 32-bit word at ``address``."""
    if _syscall_held is not None:
        _syscall_held(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _ALL, None, None, 0)
