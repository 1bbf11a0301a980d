"""A learned-reuse model's state and its compiled updates (``dpu_agent.weights.reuse``): the
per-layer predictions, clocks and evictable flags of a model's ``grid``, each layer's lowest
prediction in ``low``, and the recursive least-squares fit that makes the predictions.

Every function is compiled (Numba, cached): a visit, an insert, a removal and an eviction's
search each cost one call, cheap enough for an Arm core on the acquire path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dpu_agent.routing.stats import FEATURES
from dpu_offload.jit import keep_cache

keep_cache(__file__)

K = FEATURES
"""Features per expert (``dpu_agent.routing.stats``): a constant, selected at the last visit,
the share at each horizon."""
FLOOR = 1e-4
"""A linear fit can go below 0: clipped, or p / d would prefer the nearest layer."""


P, STAMP, HELD = 0, 1, 2
"""Planes of a model's ``grid`` (``float64[3, n, W]``, row per MoE layer, column per expert):
the predicted chance that the layer's next visit selects the expert; the policy's clock at
the end of its last use (an integer); 1.0 if the cache may evict it (resident, not in use)."""
LOW, LOW_E = 0, 1
"""Rows of a model's ``low`` (``float64[2, n]``): per layer the lowest ``P`` of a held expert
and which expert (``inf`` and -1 when none is held). Packed so that a compiled call takes two
arrays: Numba's dispatch costs ~0.15 us per array argument, a third of a hit's cost unpacked."""


@njit(cache=True, nogil=True, boundscheck=True)
def _before(grid: np.ndarray, at: int, e: int, best: int) -> bool:
    """Whether expert ``e`` of row ``at`` goes before ``best`` (-1: none yet) in the row's
    eviction order: lower ``P``, of equals the least recently used (lower ``STAMP``)."""
    return best < 0 or grid[P, at, e] < grid[P, at, best] or (
        grid[P, at, e] == grid[P, at, best] and grid[STAMP, at, e] < grid[STAMP, at, best])


@njit(cache=True, nogil=True, boundscheck=True)
def set_low(grid: np.ndarray, low: np.ndarray, at: int) -> None:
    """``low[:, at]``: the held expert of row ``at`` of lowest ``P``, of equals the least
    recently used (lowest ``STAMP``)."""
    best = -1
    for e in range(grid.shape[2]):
        if grid[HELD, at, e] and _before(grid, at, e, best):
            best = e
    low[LOW_E, at] = best
    low[LOW, at] = np.inf if best < 0 else grid[P, at, best]


@njit(cache=True, nogil=True, boundscheck=True)
def lowest_among(grid: np.ndarray, at: int, experts: np.ndarray) -> int:
    """Of ``experts`` (``int64[m]``, expert numbers of row ``at``), the held one of lowest
    ``P``, of equals the least recently used; -1 when none is held (numbers past the row's
    width are not)."""
    best = -1
    for e in experts:
        if 0 <= e < grid.shape[2] and grid[HELD, at, e] and _before(grid, at, e, best):
            best = e
    return best


@njit(cache=True, nogil=True, boundscheck=True)
def hold(grid: np.ndarray, low: np.ndarray, at: int, e: int) -> None:
    """Expert ``e`` of row ``at`` is evictable."""
    grid[HELD, at, e] = 1.0
    p, best = grid[P, at, e], int(low[LOW_E, at])
    if p < low[LOW, at] or (p == low[LOW, at] and grid[STAMP, at, e] < grid[STAMP, at, best]):
        low[LOW, at] = p
        low[LOW_E, at] = e


@njit(cache=True, nogil=True, boundscheck=True)
def insert(grid: np.ndarray, low: np.ndarray, at: int, e: int, clock: float) -> None:
    """Expert ``e`` of row ``at``'s use ended at ``clock``: evictable."""
    grid[STAMP, at, e] = clock
    hold(grid, low, at, e)


@njit(cache=True, nogil=True, boundscheck=True)
def free(grid: np.ndarray, low: np.ndarray, at: int, e: int) -> None:
    """Expert ``e`` of row ``at`` is not evictable any more."""
    grid[HELD, at, e] = 0.0
    if low[LOW_E, at] == e:
        set_low(grid, low, at)


@njit(cache=True, nogil=True, boundscheck=True)
def take(grid: np.ndarray, low: np.ndarray, now: int) -> tuple[int, int, float]:
    """The held expert of least ``P / d`` (row ``at``, expert ``e``), ``d`` the steps from
    filling the layer at row ``now`` (0 if negative) until row ``at``'s layer comes round
    (``n`` for itself), of equals in a row the least recently used, made not held; returns
    (at, e, P / d), (-1, -1, inf) when none is held."""
    n = low.shape[1]
    now = max(now, 0)
    best, at = np.inf, -1
    for i in range(n):
        d = (i - now) % n
        v = low[LOW, i] / (d if d else n)
        if v < best:
            best, at = v, i
    if at < 0:
        return -1, -1, best
    e = int(low[LOW_E, at])
    free(grid, low, at, e)
    return at, e, best


@njit(cache=True, nogil=True, boundscheck=True)
def predict(features: np.ndarray, weights: np.ndarray, grid: np.ndarray, low: np.ndarray,
             at: int) -> None:
    """Row ``at`` of ``P``: ``clip(features[:, :K] @ weights, FLOOR, 1)`` for the layer's
    experts (``features``: ``float64[E, >= K]``); then its ``low``."""
    for e in range(features.shape[0]):
        v = 0.0
        for f in range(K):
            v += features[e, f] * weights[f]
        grid[P, at, e] = min(max(v, FLOOR), 1.0)
    set_low(grid, low, at)


@njit(cache=True, nogil=True, boundscheck=True)
def learn(acc: np.ndarray, x: np.ndarray, forget: float, ridge: float, weights: np.ndarray
           ) -> None:
    """One visit's least-squares update: ``acc = forget * acc + x^T x`` (``x``:
    ``float64[E, K + 1]``, features and target), then ``weights`` solves ``(acc[:K, :K] +
    ridge I) w = acc[:K, K]`` by Cholesky (kept as they were if that is not positive definite,
    which the ridge rules out)."""
    n = K + 1
    for i in range(n):
        for j in range(n):
            acc[i, j] *= forget
    for e in range(x.shape[0]):
        for i in range(n):
            xi = x[e, i]
            if xi != 0.0:
                for j in range(n):
                    acc[i, j] += xi * x[e, j]
    chol = np.zeros((K, K))
    for i in range(K):
        for j in range(i + 1):
            v = acc[i, j] + (ridge if i == j else 0.0)
            for m in range(j):
                v -= chol[i, m] * chol[j, m]
            if i == j:
                if v <= 0.0:
                    return
                chol[i, i] = np.sqrt(v)
            else:
                chol[i, j] = v / chol[j, j]
    y = np.empty(K)
    for i in range(K):
        v = acc[i, K]
        for m in range(i):
            v -= chol[i, m] * y[m]
        y[i] = v / chol[i, i]
    for i in range(K - 1, -1, -1):
        v = y[i]
        for m in range(i + 1, K):
            v -= chol[m, i] * weights[m]
        weights[i] = v / chol[i, i]


@njit(cache=True, nogil=True, boundscheck=True)
def learn_predict(acc: np.ndarray, x: np.ndarray, forget: float, ridge: float,
                   weights: np.ndarray, features: np.ndarray, grid: np.ndarray, low: np.ndarray,
                   at: int) -> None:
    """``learn`` then ``predict``."""
    learn(acc, x, forget, ridge, weights)
    predict(features, weights, grid, low, at)
