"""Routing load per model, accumulated from ReportRouting with exponential decay: the
``[layers, experts]`` array the placement planner balances."""

from __future__ import annotations

import threading

import numpy as np

from dpu_agent.weights.catalog import ModelCatalog


class RoutingStats:
    """Decayed tokens per (MoE layer position, expert) for each model.

    Args:
        half_life_steps: a layer's counts halve after this many observed steps of that layer.
    """

    def __init__(self, half_life_steps: float = 256.0) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._lock = threading.Lock()
        self._load: dict[str, np.ndarray] = {}
        self._layers: dict[str, dict[int, int]] = {}

    def observe(self, catalog: ModelCatalog, layer: int, tokens: dict[int, int]) -> None:
        with self._lock:
            load = self._load.get(catalog.name)
            if load is None:
                load = np.zeros((len(catalog.layout.moe_layers),
                                 catalog.layout.experts_per_layer))
                self._load[catalog.name] = load
                self._layers[catalog.name] = {la: i for i, la in
                                              enumerate(catalog.layout.moe_layers)}
            row = load[self._layers[catalog.name][layer]]
            row *= self._decay
            for e, n in tokens.items():
                row[e] += n

    def load(self, model: str) -> np.ndarray | None:
        """A copy of the model's ``[moe layers, experts]`` load, or None if nothing was seen."""
        with self._lock:
            arr = self._load.get(model)
            return None if arr is None else arr.copy()
