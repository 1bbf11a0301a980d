"""Reporting routing to the agent off the inference thread: what each forward's MoE layers
chose goes to ``ReportRouting`` (the agent folds it into its routing statistics, which its
arena cache policy, next-layer predictor and placement planner learn from), sent by a
background thread so that a forward never waits on a gRPC call. Reports that pile up while
the agent is slow are merged into one call; beyond ``max_pending`` they are dropped and
counted (routing statistics are a hint: a lost report costs accuracy, never correctness).
"""

from __future__ import annotations

import logging
import queue
import threading

from dpu_offload.keys import MAX_STEPS_PER_REPORT
from host_client.client import AgentClient
from host_client.errors import AgentError

log = logging.getLogger("host_client")

Steps = list[tuple[int, dict[int, int]]]
"""(MoE layer, {expert: tokens that chose it}) per visit, in the order the layers ran."""


class RoutingReporter:
    """Collects one forward's routing (:meth:`record` per MoE layer, :meth:`flush` at the
    forward's end) and sends it to the agent from a background thread.

    Args:
        client: the session to report through.
        model: the agent's name for the model.
        max_pending: forwards' reports that may wait for the sender; more are dropped.

    Attributes:
        reports_sent: ReportRouting calls made; ``visits_sent``: layer visits they carried.
        dropped: forwards' reports dropped because ``max_pending`` were waiting.
        failed: calls the agent refused or that found it away (their visits are lost).
    """

    def __init__(self, client: AgentClient, model: str, max_pending: int = 64) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.client, self.model = client, model
        self._current: Steps = []
        self._pending: queue.Queue[Steps | None] = queue.Queue(max_pending)
        self.reports_sent = self.visits_sent = self.dropped = self.failed = 0
        self._thread = threading.Thread(target=self._send_loop, name="routing-reports",
                                        daemon=True)
        self._thread.start()

    def record(self, layer: int, counts: dict[int, int]) -> None:
        """One MoE layer's choice in the current forward: ``counts[e]`` tokens chose expert
        ``e`` (experts no token chose are left out)."""
        self._current.append((layer, counts))

    def flush(self) -> None:
        """End the current forward: hand its routing to the sender (or drop it, counted)."""
        steps, self._current = self._current, []
        if not steps:
            return
        try:
            self._pending.put_nowait(steps)
        except queue.Full:
            self.dropped += 1

    def _send_loop(self) -> None:
        while True:
            steps = self._pending.get()
            if steps is None:
                return
            closing = False
            while len(steps) < MAX_STEPS_PER_REPORT:  # merge what piled up meanwhile
                try:
                    more = self._pending.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                steps += more
            for first in range(0, len(steps), MAX_STEPS_PER_REPORT):
                part = steps[first:first + MAX_STEPS_PER_REPORT]
                try:
                    self.client.report_routing(self.model, part)
                except AgentError as exc:
                    self.failed += 1
                    log.debug("routing report of %d visits lost: %s", len(part), exc)
                    continue
                self.reports_sent += 1
                self.visits_sent += len(part)
            if closing:
                return

    def close(self, timeout: float = 10.0) -> None:
        """Send what was recorded and stop the sender (waits up to ``timeout`` s for it)."""
        self.flush()
        self._pending.put(None)
        self._thread.join(timeout)
