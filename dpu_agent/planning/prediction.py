"""Which experts the next MoE layer will select, predicted from the routing the agent is told
(ReportRouting, in the agent's routing statistics), so that a prefetch can start before the
layer asks.

Two signals, learned online with no offline training: how a layer's selection predicts the
next layer's (the statistics' transition counts between consecutive MoE layers), and the next
layer's own recent history (selected at its last visit, its share of recent visits). A
per-model history can be learned from a recorded trace first (``RoutingStats.learn``).
"""

from __future__ import annotations

import numpy as np

from dpu_agent.routing.stats import LAST, SHARE, RoutingStats

HISTORY_HORIZON = 16.0
"""The next layer's share of selections over this many of its visits is half its history."""


class NextLayerPredictor:
    """Predicts the experts of the MoE layer after the last visit ``stats`` observed.

    Args:
        stats: the agent's routing statistics.
        history_weight: weight of the next layer's own history against the transitions.
    """

    def __init__(self, stats: RoutingStats, history_weight: float = 0.5) -> None:
        self.stats = stats
        self.history_weight = history_weight

    def predict(self, model: str, k: int) -> tuple[int, list[int]]:
        """(number of the next MoE layer, its ``k`` likeliest experts, best first) after the
        last visit observed; (-1, []) before any."""
        stats = self.stats.model(model)
        if stats.previous is None or k <= 0:
            return -1, []
        layer, chosen = stats.previous
        nxt = stats.next_layer(layer)
        features = stats.layers[nxt].features
        score = self.history_weight * (0.5 * features[:, LAST]
                                       + 0.5 * features[:, SHARE[HISTORY_HORIZON]])
        onward = stats.layers[layer].onward
        if chosen.size:
            rows = onward[chosen]
            votes = (rows / np.maximum(rows.sum(axis=1, keepdims=True), 1e-9)).sum(axis=0)
            width = min(votes.size, score.size)  # layers seen with fewer experts so far
            score[:width] += votes[:width]
        best = np.argsort(-score, kind="stable")[:k]
        return nxt, [int(e) for e in best if score[e] > 0]
