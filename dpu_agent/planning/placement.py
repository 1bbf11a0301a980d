"""The placement planner: which GPUs hold which experts, balanced first, cheap to reach second.

Per layer, independently:

1. **Replicas.** ``replicas`` extra copies go one at a time to the expert whose per-copy load is
   highest (EPLB's rule), never more copies than GPUs.
2. **Balance.** Copies are packed longest-processing-time first (heaviest per-copy load first,
   onto the least-loaded GPU with a free slot that does not hold the expert yet). This gives the
   reference makespan ``M``.
3. **Stay.** With a ``current`` placement, two candidates are compared and the one moving
   fewer copies wins: (a) the LPT packing with its GPUs relabelled by an assignment step
   (GPUs of equal capacity are interchangeable, so each new bin goes to the GPU that already
   holds most of its experts: a maximum-weight matching; balance unchanged); (b) a repair of
   the current placement: copy counts fixed, then single moves or swaps off the most loaded
   GPU until it is within ``M * (1 + slack)``. Balance first, then bytes.

Capacities are slots per layer per GPU (heterogeneous allowed), or bytes per GPU with
``expert_bytes`` (then divided evenly over the layers).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from dpu_offload.jit import keep_cache

keep_cache(__file__)

REPAIR_STEPS = 4096
"""Moves and swaps a repair may make in one layer before it gives up (the LPT packing,
relabelled, is used then)."""

Assignment = list[list[list[int]]]
"""``assignment[layer][expert]`` = sorted GPU indices holding that expert."""


class PlacementError(ValueError):
    """The inputs admit no placement; the message names the constraint that fails."""


@dataclass(frozen=True)
class Placement:
    """A placement and its figures.

    Attributes:
        assignment: ``[layers][experts]`` -> GPU indices.
        gpu_load: ``float64[layers, gpus]`` tokens per GPU, an expert's load split evenly over
            its copies.
        max_load_ratio: max over layers of (max GPU load / mean GPU load); 1.0 is perfect.
        bytes_moved: bytes of expert copies that are new relative to ``current`` (0 without).
        copies_moved: how many (layer, expert, GPU) copies are new.
    """

    assignment: Assignment
    gpu_load: np.ndarray
    max_load_ratio: float
    bytes_moved: int
    copies_moved: int

    def to_json(self) -> dict[str, object]:
        return {"max_load_ratio": self.max_load_ratio, "bytes_moved": self.bytes_moved,
                "copies_moved": self.copies_moved, "assignment": self.assignment}


def _validate(load: np.ndarray, slots: np.ndarray, replicas: int) -> None:
    if load.ndim != 2 or 0 in load.shape:
        raise PlacementError(f"load must have shape [layers, experts], got {list(load.shape)}")
    if not np.all(np.isfinite(load)):
        raise PlacementError("load holds NaN or infinite entries")
    if np.any(load < 0):
        raise PlacementError("load holds negative entries")
    experts = load.shape[1]
    if slots.size == 0 or np.any(slots <= 0):
        raise PlacementError("every GPU needs a positive capacity")
    total = int(slots.sum())
    if total < experts:
        raise PlacementError(f"GPU capacity of {total} slots per layer cannot hold one copy of "
                             f"each of {experts} experts")
    if replicas < 0:
        raise PlacementError(f"replicas must be >= 0, got {replicas}")
    if replicas > experts * (slots.size - 1):
        raise PlacementError(f"replica budget {replicas} exceeds the {experts * (slots.size - 1)}"
                             f" distinct extra copies {slots.size} GPUs can hold")
    if experts + replicas > total:
        raise PlacementError(f"replica budget {replicas} exceeds the {total - experts} free "
                             "slots per layer")


def _held(current: Assignment, layers: int, experts: int, gpus: int) -> np.ndarray:
    """``bool[layers, experts, gpus]``: the placement ``current`` as a matrix. PlacementError
    naming what is wrong: its shape, or the layer and expert of a GPU id that is not an
    integer or not one of the ``gpus``."""
    shape = f"[{layers} layers][{experts} experts] lists of GPU indices"
    try:
        if len(current) != layers or any(len(row) != experts for row in current):
            raise PlacementError(f"current placement is not {shape}")
        sizes = [len(gs) for row in current for gs in row]
        flat = [g for row in current for gs in row for g in gs]
    except TypeError as exc:
        raise PlacementError(f"current placement is not {shape} ({exc})") from exc
    where = np.repeat(np.arange(layers * experts), sizes)
    bad = next((i for i, g in enumerate(flat) if isinstance(g, bool) or
                not isinstance(g, (int, np.integer)) or not 0 <= g < gpus), -1)
    if bad >= 0:
        layer, e = divmod(int(where[bad]), experts)
        raise PlacementError(f"current placement names unknown GPU {flat[bad]!r} for layer "
                             f"{layer} expert {e}")
    held = np.zeros((layers * experts, gpus), np.bool_)
    held[where, np.array(flat, np.int64)] = True
    return held.reshape(layers, experts, gpus)


def _copies(layer_load: np.ndarray, replicas: int, gpus: int) -> np.ndarray:
    copies = np.ones(layer_load.size, dtype=np.int64)
    heap = [(-float(x), e) for e, x in enumerate(layer_load)]
    heapq.heapify(heap)
    added = 0
    while added < replicas and heap:
        _, e = heapq.heappop(heap)
        if copies[e] >= gpus:
            continue
        copies[e] += 1
        added += 1
        heapq.heappush(heap, (-float(layer_load[e]) / copies[e], e))
    return copies


# The per-layer steps are compiled loops over ``held`` (``bool[E, G]``: expert e has a copy on
# GPU g): at DeepSeek-V3 scale a rebalance is 58 of them, and in Python they took ~3 ms each.


@njit(cache=True, nogil=True, boundscheck=True)
def _pack(w: np.ndarray, copies: np.ndarray, slots: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, bool]:
    """LPT: copies by per-copy load ``w`` (heaviest first, then by expert), each onto the GPU
    of least load (then most free slots, then lowest index) with a free slot that does not
    hold the expert. Returns ``held``, ``float64[G]`` load, and False if a copy found no
    GPU."""
    experts, gpus = w.size, slots.size
    held = np.zeros((experts, gpus), np.bool_)
    free = slots.copy()
    load = np.zeros(gpus)
    for e in np.argsort(-w, kind="mergesort"):
        for _ in range(copies[e]):
            best = -1
            for g in range(gpus):
                if free[g] <= 0 or held[e, g]:
                    continue
                if best < 0 or load[g] < load[best] or (load[g] == load[best]
                                                        and free[g] > free[best]):
                    best = g
            if best < 0:
                return held, load, False
            held[e, best] = True
            free[best] -= 1
            load[best] += w[e]
    return held, load, True


@njit(cache=True, nogil=True, boundscheck=True)
def _repair(w: np.ndarray, copies: np.ndarray, slots: np.ndarray, current: np.ndarray,
            bound: float, max_steps: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Start from ``current`` (``bool[E, G]``) and make the fewest changes that reach
    ``bound``: fix copy counts (surplus copies leave the fullest GPUs, missing ones go to the
    least loaded), then move or swap copies off the most loaded GPU, each step the change
    that lowers the pair's larger load most. Returns ``held``, its load and whether it
    reached ``bound``."""
    experts, gpus = w.size, slots.size
    held = current.copy()
    count = np.zeros(gpus, np.int64)
    for e in range(experts):
        for g in range(gpus):
            count[g] += held[e, g]
    load = np.zeros(gpus)
    if np.any(count > slots):
        return held, load, False
    for e in range(experts):
        n = held[e].sum()
        while n > copies[e]:
            top = -1
            for g in range(gpus):
                if held[e, g] and (top < 0 or count[g] > count[top]):
                    top = g
            held[e, top] = False
            count[top] -= 1
            n -= 1
    for e in range(experts):
        for g in range(gpus):
            if held[e, g]:
                load[g] += w[e]
    for e in np.argsort(-w, kind="mergesort"):
        n = held[e].sum()
        while n < copies[e]:
            low = -1
            for g in range(gpus):
                if count[g] < slots[g] and not held[e, g] and (low < 0 or load[g] < load[low]):
                    low = g
            if low < 0:
                return held, load, False
            held[e, low] = True
            count[low] += 1
            load[low] += w[e]
            n += 1
    for _ in range(max_steps):
        hi = int(np.argmax(load))
        if load[hi] <= bound:
            return held, load, True
        on_hi = np.flatnonzero(held[:, hi])
        best, e_out, target, e_in = np.inf, -1, -1, -1
        for lo in np.argsort(load, kind="mergesort"):
            if lo == hi or load[lo] >= load[hi]:
                break
            on_lo = np.flatnonzero(held[:, lo])
            for e in on_hi:
                if held[e, lo]:
                    continue
                if count[lo] < slots[lo]:
                    pair = max(load[hi] - w[e], load[lo] + w[e])
                    if pair < load[hi] and pair < best:
                        best, e_out, target, e_in = pair, e, lo, -1
                for f in on_lo:
                    if w[f] >= w[e] or held[f, hi]:
                        continue
                    pair = max(load[hi] - w[e] + w[f], load[lo] + w[e] - w[f])
                    if pair < load[hi] and pair < best:
                        best, e_out, target, e_in = pair, e, lo, f
            if e_out >= 0:
                break
        if e_out < 0:
            return held, load, False
        held[e_out, hi], held[e_out, target] = False, True
        load[hi] -= w[e_out]
        load[target] += w[e_out]
        if e_in >= 0:
            held[e_in, target], held[e_in, hi] = False, True
            load[target] -= w[e_in]
            load[hi] += w[e_in]
        else:
            count[hi] -= 1
            count[target] += 1
    return held, load, False


def _relabel(held: np.ndarray, load: np.ndarray, slots: np.ndarray, current: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """Permute GPU labels among GPUs of equal capacity to maximise copies kept in place (a
    maximum-weight matching per capacity on ``overlap[new bin, current GPU]``)."""
    from scipy.optimize import linear_sum_assignment  # here: importing it doubles start-up

    overlap = held.T.astype(np.int64) @ current.astype(np.int64)
    mapping = np.arange(slots.size)
    for cap in np.unique(slots):
        group = np.flatnonzero(slots == cap)
        rows, cols = linear_sum_assignment(-overlap[np.ix_(group, group)])
        mapping[group[rows]] = group[cols]
    relabelled = np.zeros_like(held)
    relabelled[:, mapping] = held
    new_load = np.zeros_like(load)
    new_load[mapping] = load
    return relabelled, new_load


def _lists(held: np.ndarray) -> list[list[int]]:
    """``held`` (``bool[E, G]``) as, per expert, the sorted GPU indices holding it."""
    experts, gpus = np.nonzero(held)
    ends = np.searchsorted(experts, np.arange(1, held.shape[0] + 1)).tolist()
    flat = gpus.tolist()
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def warm_up() -> None:
    """Compile (or load from Numba's cache) the planner's loops, so that no ApplyPlacement or
    Rebalance pays for it (seconds on a cold cache)."""
    w, copies, slots = np.array([3.0, 1.0, 2.0]), np.array([2, 1, 1]), np.array([2, 2])
    held, load, _ = _pack(w, copies, slots)
    _repair(w[::-1].copy(), copies, slots, held, float(load.max()), REPAIR_STEPS)


def plan(load: np.ndarray | Sequence[Sequence[float]], gpus: Sequence[int] | int, *,
         current: Assignment | None = None, replicas: int = 0,
         expert_bytes: int | Sequence[int] | None = None, capacity: str = "slots",
         slack: float = 0.02) -> Placement:
    """Plan a placement.

    Args:
        load: ``[layers, experts]`` tokens routed to each expert over a window.
        gpus: per GPU, its capacity: slots per layer (``capacity="slots"``) or bytes for the
            whole model (``capacity="bytes"``, needs ``expert_bytes``); an int N means N GPUs
            with just enough slots for one copy of everything plus the replicas.
        current: the placement in force (``[layers][experts]`` -> GPUs), or None.
        replicas: redundant copies to add per layer (hot experts get them).
        expert_bytes: bytes per expert (one number, or one per layer), for ``bytes_moved``
            and byte capacities.
        capacity: "slots" or "bytes": the unit of ``gpus``.
        slack: balance tolerance for keeping experts where they are.

    Raises:
        PlacementError: naming the constraint that fails; nothing is planned.
    """
    load = np.asarray(load, dtype=np.float64)
    layers = load.shape[0] if load.ndim == 2 else 0
    experts = load.shape[1] if load.ndim == 2 else 0
    per_layer_bytes = (np.full(layers, int(expert_bytes)) if isinstance(expert_bytes, int)
                       else np.asarray(expert_bytes, dtype=np.int64) if expert_bytes is not None
                       else np.zeros(layers, dtype=np.int64))
    if isinstance(gpus, int):
        if gpus <= 0:
            raise PlacementError(f"need at least one GPU, got {gpus}")
        slots = np.full(gpus, -(-(experts + replicas) // gpus), dtype=np.int64)
    elif capacity == "bytes":
        if expert_bytes is None:
            raise PlacementError("capacities in bytes need expert_bytes")
        biggest = int(per_layer_bytes.max()) if per_layer_bytes.size else 1
        if biggest <= 0:
            raise PlacementError("expert_bytes must be positive")
        slots = np.asarray([int(b) // biggest // max(layers, 1) for b in gpus], dtype=np.int64)
    elif capacity == "slots":
        slots = np.asarray(list(gpus), dtype=np.int64)
    else:
        raise PlacementError(f"capacity must be 'slots' or 'bytes', got {capacity!r}")
    _validate(load, slots, replicas)
    if per_layer_bytes.shape != (layers,):
        raise PlacementError(f"expert_bytes must be one number or one per layer ({layers}), "
                             f"got {per_layer_bytes.size}")
    before = _held(current, layers, experts, slots.size) if current is not None else None
    held = np.zeros((layers, experts, slots.size), np.bool_)
    gpu_load = np.zeros((layers, slots.size))
    for layer in range(layers):
        row = load[layer]
        copies = _copies(row, replicas, slots.size)
        w = row / copies
        lpt, lpt_load, packed = _pack(w, copies, slots)
        if not packed:
            raise PlacementError("no GPU has a free slot for another copy")
        chosen, chosen_load = lpt, lpt_load
        if before is not None:
            now = before[layer]
            chosen, chosen_load = _relabel(lpt, lpt_load, slots, now)
            repaired, repaired_load, ok = _repair(w, copies, slots, now,
                                                  lpt_load.max() * (1 + slack), REPAIR_STEPS)
            if ok and (repaired & ~now).sum() < (chosen & ~now).sum():
                chosen, chosen_load = repaired, repaired_load
        held[layer] = chosen
        gpu_load[layer] = chosen_load
    means = gpu_load.mean(axis=1)
    ratios = np.where(means > 0, gpu_load.max(axis=1) / np.where(means > 0, means, 1), 1.0)
    new = (held & ~before).sum(axis=(1, 2)) if before is not None else np.zeros(layers, int)
    return Placement([_lists(h) for h in held], gpu_load, float(ratios.max()),
                     int(new @ per_layer_bytes), int(new.sum()))
