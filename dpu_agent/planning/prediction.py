"""Which experts the next MoE layer will select, predicted from the routing the agent is told
(ReportRouting), so that a prefetch can start before the layer asks.

Two signals, learned online with no offline training: how a layer's selection predicts the
next layer's (transition counts per pair of consecutive MoE layers, decayed), and the next
layer's own recent history (selected at its last visit, its decayed share of visits). A
per-model table can be learned from a recorded trace first (:meth:`NextLayerPredictor.learn`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from dpu_agent.planning.traces import RoutingStep


class _ModelRouting:
    """One model's transition counts ``[positions, E, E]`` (from position p to p + 1, the last
    to the first), each position's last selection ``[positions, E]`` and decayed selection
    share ``[positions, E]``, and the last step seen (position, experts)."""

    def __init__(self, positions: int, experts: int) -> None:
        self.transitions = np.zeros((positions, experts, experts), np.float32)
        self.last = np.zeros((positions, experts), np.float32)
        self.share = np.zeros((positions, experts), np.float32)
        self.previous: tuple[int, list[int]] | None = None


class NextLayerPredictor:
    """Predicts the experts of the MoE layer after a reported step.

    Args:
        decay: per observed transition, how much earlier transition counts keep.
        share_decay: per visit of a layer, how much its earlier selections keep.
        history_weight: weight of the next layer's own history against the transitions.
    """

    def __init__(self, decay: float = 0.995, share_decay: float = 0.95,
                 history_weight: float = 0.5) -> None:
        self.decay, self.share_decay, self.history_weight = decay, share_decay, history_weight
        self._models: dict[str, _ModelRouting] = {}
        self._lock = threading.Lock()

    def observe(self, model: str, position: int, positions: int, experts_per_layer: int,
                chosen: Iterable[int]) -> None:
        """One step: the MoE layer at ``position`` (of ``positions``) selected ``chosen``."""
        picked = sorted(set(chosen))
        with self._lock:
            m = self._models.get(model)
            if m is None or m.last.shape != (positions, experts_per_layer):
                m = self._models[model] = _ModelRouting(positions, experts_per_layer)
            if m.previous is not None and (m.previous[0] + 1) % positions == position \
                    and m.previous[1] and picked:
                t = m.transitions[m.previous[0]]
                t *= self.decay
                t[np.ix_(m.previous[1], picked)] += 1.0
            m.last[position] = 0.0
            m.last[position, picked] = 1.0
            m.share[position] *= self.share_decay
            m.share[position, picked] += 1.0 - self.share_decay
            m.previous = (position, picked)

    def learn(self, model: str, positions: list[int], experts_per_layer: int,
              steps: Iterable[RoutingStep]) -> int:
        """Learn from a recorded trace (``steps`` in decode order, layers named as in
        ``positions``, the model's MoE layers in order); steps of other layers are skipped.
        Returns how many steps were used."""
        at = {layer: i for i, layer in enumerate(positions)}
        used = 0
        for step in steps:
            if step.layer in at and all(0 <= e < experts_per_layer for e in step.experts):
                self.observe(model, at[step.layer], len(positions), experts_per_layer,
                             step.experts)
                used += 1
        return used

    def predict(self, model: str, k: int) -> tuple[int, list[int]]:
        """(position of the next MoE layer, its ``k`` likeliest experts, best first) after the
        last step observed; (-1, []) before any."""
        with self._lock:
            m = self._models.get(model)
            if m is None or m.previous is None or k <= 0:
                return -1, []
            position, chosen = m.previous
            nxt = (position + 1) % m.last.shape[0]
            score = self.history_weight * (0.5 * m.last[nxt] + 0.5 * m.share[nxt])
            if chosen:
                rows = m.transitions[position][chosen]
                score = score + (rows / np.maximum(rows.sum(axis=1, keepdims=True), 1e-9)
                                 ).sum(axis=0)
        best = np.argsort(-score, kind="stable")[:k]
        return nxt, [int(e) for e in best if score[e] > 0]
