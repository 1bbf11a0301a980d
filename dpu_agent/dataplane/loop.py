"""The agent's data-plane loop: one thread that polls every device's request ring and
completion ring and makes the fast-path decisions, with neither the asyncio loop nor gRPC in
between. On a BlueField it is one Arm core polling, as a DOCA progress engine would.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dpu_offload import futex
from dpu_offload.bell import Bell

log = logging.getLogger("dpu_agent.dataplane")

SPIN_SECONDS = 200e-6
"""After serving requests the loop only yields the GIL for this long (by default: the agent's
``transfer.poll_spin_us``), then naps or sleeps: a layer's next batch often follows. After a
ring that woke it to nothing yet (a client announces a post it is preparing) too. After
completions alone only while more are awaited that come unrung (a device consumer's): the
DMA engine rings for its own."""
NAP_SECONDS = 20e-6
"""Nap between polls while something it waits for closely comes without a bell (a device
consumer's completions)."""
DOZE_SECONDS = 0.05
"""Otherwise the loop sleeps on the doorbell (``dpu_offload.bell``) for at most this long (or
less, as ``doze_limit`` says): a client's post, the DMA engine's completions or the agent's
own delivery wake it sooner; sweeps wait at most this."""
SWEEP_SECONDS = 0.5
"""How often the stuck-transfer sweep runs."""
IDLE, COMPLETED, SERVED = 0, 1, 2
"""What a pass found: nothing, completions alone, requests (and maybe completions)."""


@dataclass
class LoopStats:
    """What the loop did, for metrics and benchmarks."""

    completions: int = 0
    errors: int = 0
    """Passes that raised (logged; the loop goes on)."""
    cpu_seconds: float = 0.0
    """CPU time of the loop's thread (``time.thread_time``), updated after every pass that
    found work and at every sweep (reading it is a system call, not to be paid per idle pass)."""


class DataPlaneLoop:
    """Runs ``poll_once`` on its own thread until stopped.

    Args:
        poll: one pass over every source; returns how many entries (requests and completions)
            it handled.
        doze_limit: how long the loop may sleep on ``bell`` now, seconds (at most
            ``DOZE_SECONDS``): 0 while something it waits for closely comes without a ring (it
            naps ``NAP_SECONDS`` between polls instead), a bound where something it may take up
            later comes without a ring (a consumer's verdict).
        sweep: called every ``SWEEP_SECONDS`` (stuck transfers, dead engines).
        bell: what the loop sleeps on otherwise (None: it naps instead).
        spin: seconds the loop polls after work before it naps or sleeps.
    """

    def __init__(self, poll: Callable[[], tuple[int, int]], doze_limit: Callable[[], float],
                 sweep: Iterable[Callable[[], None]], bell: Bell | None = None,
                 spin: float = SPIN_SECONDS) -> None:
        self._poll = poll
        self._doze_limit = doze_limit
        self._spin = spin
        self._sweeps = tuple(sweep)
        self._bell = bell
        self._stop = threading.Event()
        self.stats = LoopStats()
        self.heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="dataplane", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        futex.tight_timer_slack("dataplane")
        last_work = last_sweep = time.monotonic()
        stats = self.stats
        woken = False
        """The last sleep was ended by a ring."""
        while not self._stop.is_set():
            now = self.heartbeat = time.monotonic()
            if now - last_sweep > SWEEP_SECONDS:
                last_sweep = now
                stats.cpu_seconds = time.thread_time()
                for sweep in self._sweeps:
                    try:
                        sweep()
                    except Exception:
                        log.exception("data-plane sweep failed")
            found = self._one_pass()
            if found != IDLE:
                # Completions that come unrung (a device consumer's) are polled closely too.
                if found == SERVED or self._doze_limit() <= 0.0:
                    last_work = now
                woken = False
                continue
            if woken:  # rung with nothing to take: a client announced its post
                last_work, woken = now, False
            if now - last_work < self._spin:
                time.sleep(0)
                continue
            bell = self._bell
            limit = min(DOZE_SECONDS, self._doze_limit(), SWEEP_SECONDS - (now - last_sweep))
            if bell is None or limit <= 0.0:
                time.sleep(NAP_SECONDS)
            elif bell.doze(limit, self._one_pass, lambda found: found == IDLE) == SERVED:
                last_work = time.monotonic()
            else:
                woken = bell.rung

    def _one_pass(self) -> int:
        """Poll every source once; what it found (``IDLE``, ``COMPLETED``, ``SERVED``)."""
        stats = self.stats
        try:
            requests, completions = self._poll()
        except Exception:  # a bug must not stop the data plane: logged, counted
            log.exception("data-plane pass failed")
            stats.errors += 1
            return IDLE
        stats.completions += completions
        if requests or completions:
            stats.cpu_seconds = time.thread_time()
            return SERVED if requests else COMPLETED
        return IDLE

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._bell is not None:
            self._bell.ring()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
