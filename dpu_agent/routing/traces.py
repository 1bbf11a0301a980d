"""Routing traces: the documented JSON-lines format (docs/LAYOUT.md) and a generator with
realistic skew (Zipf popularity per layer) and drift (popularity ranks shuffle over time)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class RoutingStep:
    """The experts one step (a token at one layer) selected; repeats allowed."""

    layer: int
    experts: tuple[int, ...]


def read_trace(path: str | Path) -> list[RoutingStep]:
    """Parse a trace; ValueError naming the line when one is malformed."""
    steps = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                layer = obj["layer"]
                experts = obj["experts"]
                if not isinstance(layer, int) or layer < 0 or not isinstance(experts, list) \
                        or not all(isinstance(e, int) and e >= 0 for e in experts):
                    raise ValueError("layer must be an int >= 0, experts a list of ints >= 0")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{n}: not a trace step ({exc})") from exc
            steps.append(RoutingStep(layer, tuple(experts)))
    return steps


def write_trace(path: str | Path, steps: list[RoutingStep]) -> None:
    Path(path).write_text("".join(json.dumps({"layer": s.layer, "experts": list(s.experts)})
                                  + "\n" for s in steps))


def generate_trace(layers: int, experts: int, top_k: int, tokens: int, *, zipf: float = 1.1,
                   drift_every: int = 64, drift_swaps: int = 2, seed: int = 0
                   ) -> Iterator[RoutingStep]:
    """Decode order: each token visits every layer in order. Expert popularity in a layer is
    Zipf(``zipf``) over a per-layer random ranking; every ``drift_every`` tokens,
    ``drift_swaps`` random pairs of ranks swap in every layer."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** zipf
    weights /= weights.sum()
    ranking = [rng.permutation(experts) for _ in range(layers)]
    for t in range(tokens):
        if t and t % drift_every == 0:
            for r in ranking:
                for _ in range(drift_swaps):
                    i, j = rng.integers(0, experts, 2)
                    r[i], r[j] = r[j], r[i]
        for layer in range(layers):
            picks = rng.choice(experts, size=top_k, replace=False, p=weights)
            yield RoutingStep(layer, tuple(int(ranking[layer][i]) for i in picks))
