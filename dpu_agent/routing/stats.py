"""The agent's one store of routing statistics: what ReportRouting said each MoE layer selected,
kept once, on one clock (visits of that layer), and read by everything that plans from routing:
the cache's eviction policy (recency and frequency per expert), the next-layer predictor
(transitions between consecutive layers, recent history) and the placement planner (token
load).

Per layer, per expert, the features of its history (``FEATURES`` columns): a constant 1,
whether the layer's last visit selected it, and its share of the visits that selected it over
each horizon of ``HALF_LIVES`` (an exponentially decayed mean, normalised by the decayed visit
count, so a young layer's shares are not biased low); its decayed token count over
``LOAD_HALF_LIFE`` visits (the load); and, per pair of consecutive MoE layers, the decayed
counts of the experts the next visit selected after each expert of this one.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np
from numba import njit

from dpu_agent.routing.traces import RoutingStep
from dpu_offload.jit import keep_cache

keep_cache(__file__)

HALF_LIVES = (1.0, 4.0, 16.0, 64.0, 256.0, math.inf)
"""Horizons of the selection shares, in visits of the layer."""
FEATURES = 2 + len(HALF_LIVES)
"""Columns of a layer's features: the constant, selected at the last visit, a share per
horizon."""
SHARE = {h: 2 + i for i, h in enumerate(HALF_LIVES)}
"""Horizon -> its column."""
LAST = 1
"""Column: selected at the layer's last visit."""
LOAD_HALF_LIFE = 256.0
"""The token load halves over this many visits of the layer."""
TRANSITION_DECAY = 0.995
"""Per observed pair of consecutive visits, how much the earlier transition counts keep."""
_DECAY = [0.5 ** (1.0 / h) for h in HALF_LIVES]
_STEP_CACHE = 4096
"""Visit counts whose feature update (``_step_table``) is kept; by then every finite horizon's
decayed visit count has converged (to 2e-5 at 256 visits), only the unbounded one moves."""


def _step_table() -> np.ndarray:
    """``float64[_STEP_CACHE, 2, FEATURES]``: row ``t`` is ``(a, b)``, the feature update of a
    layer's ``t``-th visit, the same for every layer: the features become ``a * features + b *
    selected`` per column (``a = decay V_t / V_t+1``, ``b = 1 / V_t+1`` for a share, ``V_t =
    (1 - decay^t) / (1 - decay)`` the decayed visit count; 0 and 1 for the last-visit flag; 1
    and 0 for the constant)."""
    t = np.arange(_STEP_CACHE + 1, dtype=np.float64)[:, None]
    decay = np.array(_DECAY)[None, :]
    finite = decay < 1.0
    visits = np.where(finite, (1.0 - decay ** t) / np.where(finite, 1.0 - decay, 1.0), t)
    table = np.zeros((_STEP_CACHE, 2, FEATURES))
    table[:, 0, 0] = 1.0
    table[:, 0, 2:] = decay * visits[:-1] / visits[1:]
    table[:, 1, LAST] = 1.0
    table[:, 1, 2:] = 1.0 / visits[1:]
    return table


_STEPS = _step_table()
_LOAD_DECAY = 0.5 ** (1.0 / LOAD_HALF_LIFE)
# The compiled loops check their indices (``boundscheck``: IndexError, never a write outside
# the arrays, at ~0.1 us a call).


@njit(cache=True, nogil=True, boundscheck=True)
def _fold(before: np.ndarray, after: np.ndarray, steps: np.ndarray, t: int,
          chosen: np.ndarray, tokens: np.ndarray, load: np.ndarray) -> None:
    """A layer's ``t``-th visit folded in, compiled (a visit is the agent's most frequent
    control-plane event): ``before``'s last column marks ``chosen``, ``after[:, :FEATURES] =
    a * before + b * selected`` per column (``a, b = steps[t]``; past the table only the
    unbounded horizon's terms still move), the load decays and gains ``tokens``. IndexError,
    changing nothing, for an expert outside the layer."""
    for e in chosen:
        if e < 0 or e >= before.shape[0]:
            raise IndexError("an expert outside the layer's statistics")
    a = steps[min(t, steps.shape[0] - 1), 0].copy()
    b = steps[min(t, steps.shape[0] - 1), 1].copy()
    if t >= steps.shape[0]:
        a[FEATURES - 1] = t / (t + 1.0)
        b[FEATURES - 1] = 1.0 / (t + 1.0)
    for e in range(before.shape[0]):
        before[e, FEATURES] = 0.0
        for f in range(FEATURES):
            after[e, f] = before[e, f] * a[f]
        load[e] *= _LOAD_DECAY
    for i in range(chosen.size):
        e = chosen[i]
        before[e, FEATURES] = 1.0
        for f in range(1, FEATURES):
            after[e, f] += b[f]
        load[e] += tokens[i]


@njit(cache=True, nogil=True, boundscheck=True)
def _count_pairs(onward: np.ndarray, chosen: np.ndarray, following: np.ndarray,
                 unit: float) -> None:
    """``onward[c, f] += unit`` for every pair of ``chosen`` and ``following`` (both distinct)."""
    for c in chosen:
        for f in following:
            onward[c, f] += unit


class LayerStats:
    """One MoE layer's routing history.

    Attributes:
        features: ``float64[E, FEATURES]`` after the last visit (see the module).
        visits: visits observed.
        load: ``float64[E]``, tokens per expert, decayed over ``LOAD_HALF_LIFE`` visits.
        onward: ``float64[E, E']``: counts of (expert of this layer's visit, expert of the next
            MoE layer's visit that followed it), each decayed by ``TRANSITION_DECAY`` per later
            pair, up to one common factor (kept apart, so a pair costs its entries, not the
            matrix: read them as ratios, as a row's distribution).
    """

    def __init__(self) -> None:
        self._buffers = [np.zeros((0, FEATURES + 1)), np.zeros((0, FEATURES + 1))]
        self._current = 0
        self.visits = 0
        self.load = np.zeros(0)
        self.onward = np.zeros((0, 0))
        self._onward_unit = 1.0

    @property
    def experts(self) -> int:
        return self.load.shape[0]

    @property
    def features(self) -> np.ndarray:
        return self._buffers[self._current][:, :FEATURES]

    def grow(self, experts: int) -> None:
        """Make room for ``experts`` (new experts: never selected)."""
        n = self.experts
        if experts <= n:
            return
        for i, buf in enumerate(self._buffers):
            rows = np.zeros((experts - n, FEATURES + 1))
            rows[:, 0] = 1.0
            self._buffers[i] = np.vstack([buf, rows])
        self.load = np.concatenate([self.load, np.zeros(experts - n)])
        self._grow_onward(experts, self.onward.shape[1])

    def _grow_onward(self, rows: int, columns: int) -> None:
        r, c = self.onward.shape
        if rows > r or columns > c:
            onward = np.zeros((max(rows, r), max(columns, c)))
            onward[:r, :c] = self.onward
            self.onward = onward

    def followed_by(self, chosen: np.ndarray, following: np.ndarray, width: int) -> None:
        """Count a pair: this layer's visit selected ``chosen``, the next MoE layer's visit
        after it ``following`` (``intp[k]`` each, below ``width``: that layer's experts)."""
        if width > self.onward.shape[1]:
            self._grow_onward(0, width)
        self._onward_unit /= TRANSITION_DECAY
        if self._onward_unit > 1e200:  # fold the common factor in before it overflows
            self.onward /= self._onward_unit
            self._onward_unit = 1.0
        _count_pairs(self.onward, chosen, following, self._onward_unit)

    def visit(self, chosen: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fold in a visit that selected ``chosen`` (``intp[k]``, distinct) with ``tokens``
        (``float64[k]``, tokens per chosen expert). Returns (before, after), each
        ``float64[E, FEATURES + 1]`` and valid until the layer's next visit: the features
        before it with a last column, whether this visit selected each expert; and the
        features after it (``features``) in the first ``FEATURES`` columns."""
        before, after = self._buffers[self._current], self._buffers[1 - self._current]
        _fold(before, after, _STEPS, self.visits, chosen, tokens, self.load)
        self._current = 1 - self._current
        self.visits += 1
        return before, after


class Visit(NamedTuple):
    """One observed visit of a MoE layer.

    Attributes:
        model, layer: where (the layer's number in the checkpoint).
        stats: the layer's statistics, already updated.
        chosen: ``intp[k]``, the distinct experts it selected.
        before: ``float64[E, FEATURES + 1]``: the features before the visit, and whether it
            selected each expert (valid until the layer's next visit).
        after: ``float64[E, FEATURES + 1]``: the features after it in the first ``FEATURES``
            columns (the layer's ``features``; valid until its next visit).
    """

    model: str
    layer: int
    stats: LayerStats
    chosen: np.ndarray
    before: np.ndarray
    after: np.ndarray


class ModelStats:
    """A model's layers in decode order (its MoE layers by number, the last followed by the
    first) and the last visit seen."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerStats] = {}
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.previous: tuple[int, np.ndarray] | None = None
        """(layer number, distinct experts selected) of the last visit."""

    def layer(self, number: int, experts: int = 0) -> LayerStats:
        stats = self.layers.get(number)
        if stats is not None and experts <= stats.experts:
            return stats
        if stats is None:
            stats = self.layers[number] = LayerStats()
            self.order = sorted(self.layers)
            self.position = {n: i for i, n in enumerate(self.order)}
        stats.grow(experts)
        return stats

    def next_layer(self, number: int) -> int:
        """The MoE layer decode visits after layer ``number``."""
        return self.order[(self.position[number] + 1) % len(self.order)]


class RoutingStats:
    """Routing statistics of every model (see the module). ``observe`` is called from the
    control thread; readers on other threads may see one visit half folded in (a prediction
    made from it is off by that visit, nothing else)."""

    def __init__(self) -> None:
        self._models: defaultdict[str, ModelStats] = defaultdict(ModelStats)
        self._lock = threading.Lock()

    def declare(self, model: str, layers: Iterable[int], experts: int) -> None:
        """The model's MoE layers and experts per layer, known before any routing (LoadModel):
        decode order and sizes are fixed from the start."""
        with self._lock:
            stats = self._models[model]
            for number in layers:
                stats.layer(number, experts)

    def model(self, model: str) -> ModelStats:
        """The model's statistics (empty if nothing was declared or observed)."""
        with self._lock:
            return self._models[model]

    def layer(self, model: str, number: int, experts: int = 0) -> LayerStats:
        """Layer ``number``'s statistics, grown to at least ``experts``."""
        with self._lock:
            return self._models[model].layer(number, experts)

    def observe(self, model: str, layer: int, tokens: Mapping[int, int]) -> Visit:
        """One visit of ``layer``: ``tokens[e]`` tokens selected expert e (experts with 0
        tokens were not selected)."""
        chosen = np.fromiter(tokens, np.intp, len(tokens))
        counts = np.fromiter(tokens.values(), np.float64, len(tokens))
        if tokens and min(tokens.values()) <= 0:
            selected = counts > 0
            chosen, counts = chosen[selected], counts[selected]
            width = int(chosen.max()) + 1 if chosen.size else 0
        else:
            width = max(tokens, default=-1) + 1
        with self._lock:
            stats = self._models[model]
            here = stats.layers.get(layer)
            if here is None or width > here.experts:
                here = stats.layer(layer, width)
            before, after = here.visit(chosen, counts)
            previous = stats.previous
            if previous is not None and chosen.size and previous[1].size \
                    and stats.next_layer(previous[0]) == layer:
                stats.layers[previous[0]].followed_by(previous[1], chosen, here.experts)
            stats.previous = (layer, chosen)
        return Visit(model, layer, here, chosen, before, after)

    def learn(self, model: str, steps: Iterable[RoutingStep], experts: int) -> int:
        """Fold in a recorded trace (``steps`` in decode order) as if reported: steps naming a
        layer the model did not declare or an expert at or above ``experts`` are skipped.
        Returns how many steps were used."""
        known = set(self.model(model).layers)
        used = 0
        for step in steps:
            if step.layer in known and all(0 <= e < experts for e in step.experts):
                self.observe(model, step.layer, Counter(step.experts))
                used += 1
        return used

    def visits(self, model: str) -> int:
        """Layer visits of ``model`` folded in so far (0 for a model never observed)."""
        with self._lock:
            stats = self._models.get(model)
            return 0 if stats is None else sum(s.visits for s in stats.layers.values())

    def load(self, model: str) -> np.ndarray | None:
        """``float64[moe layers, experts]``: decayed tokens per expert, layers in decode order;
        None before any visit of the model was observed."""
        with self._lock:
            stats = self._models.get(model)
            if stats is None or not any(s.visits for s in stats.layers.values()):
                return None
            width = max(s.experts for s in stats.layers.values())
            out = np.zeros((len(stats.order), width))
            for i, number in enumerate(stats.order):
                row = stats.layers[number].load
                out[i, :row.size] = row
            return out
