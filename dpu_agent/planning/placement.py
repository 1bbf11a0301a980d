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


def _validate(load: np.ndarray, slots: np.ndarray, replicas: int,
              current: Assignment | None) -> None:
    if load.ndim != 2 or 0 in load.shape:
        raise PlacementError(f"load must have shape [layers, experts], got {list(load.shape)}")
    if not np.all(np.isfinite(load)):
        raise PlacementError("load holds NaN or infinite entries")
    if np.any(load < 0):
        raise PlacementError("load holds negative entries")
    layers, experts = load.shape
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
    if current is not None:
        if len(current) != layers or any(len(row) != experts for row in current):
            raise PlacementError(f"current placement is not [{layers} layers][{experts} "
                                 "experts]")
        for layer, row in enumerate(current):
            for e, gpus in enumerate(row):
                bad = [g for g in gpus if not 0 <= g < slots.size]
                if bad:
                    raise PlacementError(f"current placement names unknown GPU {bad[0]} for "
                                         f"layer {layer} expert {e}")


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


def _pack(layer_load: np.ndarray, copies: np.ndarray, slots: np.ndarray
          ) -> tuple[list[list[int]], np.ndarray]:
    """LPT: heaviest copy first onto the least-loaded GPU with a free slot not holding it."""
    gpus = slots.size
    free = slots.astype(np.int64).copy()
    load = np.zeros(gpus)
    held: list[list[int]] = [[] for _ in range(layer_load.size)]
    w = layer_load / copies
    order = np.lexsort((np.arange(w.size), -w))
    heap = [(0.0, -int(free[g]), g) for g in range(gpus)]
    heapq.heapify(heap)
    for e in order.tolist():
        for _ in range(int(copies[e])):
            skipped = []
            while heap:
                item = heapq.heappop(heap)
                if item[2] not in held[e]:
                    break
                skipped.append(item)
            else:
                raise PlacementError("no GPU has a free slot for another copy")
            g = item[2]
            held[e].append(g)
            free[g] -= 1
            load[g] += w[e]
            if free[g] > 0:
                heapq.heappush(heap, (float(load[g]), -int(free[g]), g))
            for it in skipped:
                heapq.heappush(heap, it)
    return [sorted(h) for h in held], load


def _relabel(bins: list[list[int]], bin_load: np.ndarray, slots: np.ndarray,
             current: list[list[int]]) -> tuple[list[list[int]], np.ndarray]:
    """Permute GPU labels among GPUs of equal capacity to maximise copies kept in place."""
    gpus = slots.size
    members: list[set[int]] = [set() for _ in range(gpus)]  # experts per new bin
    for e, gs in enumerate(bins):
        for g in gs:
            members[g].add(e)
    holds: list[set[int]] = [set() for _ in range(gpus)]  # experts per current GPU
    for e, gs in enumerate(current):
        for g in gs:
            holds[g].add(e)
    from scipy.optimize import linear_sum_assignment  # here: importing it doubles start-up

    mapping = np.arange(gpus)
    for cap in np.unique(slots):
        group = np.flatnonzero(slots == cap)
        overlap = np.array([[len(members[i] & holds[j]) for j in group] for i in group])
        rows, cols = linear_sum_assignment(-overlap)
        mapping[group[rows]] = group[cols]
    relabelled = [sorted(int(mapping[g]) for g in gs) for gs in bins]
    new_load = np.zeros(gpus)
    new_load[mapping] = bin_load
    return relabelled, new_load


def _repair(layer_load: np.ndarray, copies: np.ndarray, slots: np.ndarray,
            current: list[list[int]], bound: float, max_steps: int = 4096
            ) -> tuple[list[list[int]], np.ndarray] | None:
    """Start from the current placement and make the fewest changes that reach ``bound``:
    fix copy counts, then move or swap copies off the most loaded GPU. None if it cannot."""
    gpus = slots.size
    held = [set(g for g in gs if 0 <= g < gpus) for gs in current]
    count = np.zeros(gpus, dtype=np.int64)
    for gs in held:
        for g in gs:
            count[g] += 1
    if np.any(count > slots):
        return None
    w = layer_load / copies
    load = np.zeros(gpus)
    for e, gs in enumerate(held):
        while len(gs) > copies[e]:  # drop surplus copies from the busiest GPUs
            g = max(gs, key=lambda g: count[g])
            gs.discard(g)
            count[g] -= 1
    for e, gs in enumerate(held):
        for g in gs:
            load[g] += w[e]
    for e in np.argsort(-w):
        while len(held[e]) < copies[e]:
            free = [g for g in range(gpus) if count[g] < slots[g] and g not in held[e]]
            if not free:
                return None
            g = min(free, key=lambda g: load[g])
            held[e].add(g)
            count[g] += 1
            load[g] += w[e]
    on: list[list[int]] = [[] for _ in range(gpus)]
    for e, gs in enumerate(held):
        for g in gs:
            on[g].append(e)
    for _ in range(max_steps):
        hi = int(np.argmax(load))
        if load[hi] <= bound:
            return [sorted(h) for h in held], load
        best = None  # (new max of the pair, e_out, target, e_in)
        for lo in np.argsort(load):
            lo = int(lo)
            if lo == hi or load[lo] >= load[hi]:
                break
            for e in on[hi]:
                if lo in held[e]:
                    continue
                if count[lo] < slots[lo]:
                    pair = max(load[hi] - w[e], load[lo] + w[e])
                    if pair < load[hi] and (best is None or pair < best[0]):
                        best = (pair, e, lo, -1)
                for f in on[lo]:
                    if w[f] >= w[e] or hi in held[f]:
                        continue
                    pair = max(load[hi] - w[e] + w[f], load[lo] + w[e] - w[f])
                    if pair < load[hi] and (best is None or pair < best[0]):
                        best = (pair, e, lo, f)
            if best is not None:
                break
        if best is None:
            return None
        _, e, lo, f = best

        def shift(x: int, src: int, dst: int) -> None:
            held[x].discard(src)
            held[x].add(dst)
            on[src].remove(x)
            on[dst].append(x)
            load[src] -= w[x]
            load[dst] += w[x]
            count[src] -= 1
            count[dst] += 1

        shift(e, hi, lo)
        if f >= 0:
            shift(f, lo, hi)
    return None


def _moved(a: list[list[int]], current: list[list[int]]) -> int:
    return sum(len(set(x) - set(y)) for x, y in zip(a, current, strict=True))


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
    _validate(load, slots, replicas, current)
    assignment: Assignment = []
    gpu_load = np.zeros((layers, slots.size))
    for layer in range(layers):
        row = load[layer]
        copies = _copies(row, replicas, slots.size)
        lpt, lpt_load = _pack(row, copies, slots)
        chosen, chosen_load = lpt, lpt_load
        if current is not None:
            chosen, chosen_load = _relabel(lpt, lpt_load, slots, current[layer])
            bound = lpt_load.max() * (1 + slack)
            repaired = _repair(row, copies, slots, current[layer], bound)
            if repaired is not None and _moved(repaired[0], current[layer]) < _moved(
                    chosen, current[layer]):
                chosen, chosen_load = repaired
        assignment.append(chosen)
        gpu_load[layer] = chosen_load
    means = gpu_load.mean(axis=1)
    ratios = np.where(means > 0, gpu_load.max(axis=1) / np.where(means > 0, means, 1), 1.0)
    copies_moved = 0
    bytes_moved = 0
    if current is not None:
        for layer in range(layers):
            for e in range(experts):
                new = len(set(assignment[layer][e]) - set(current[layer][e]))
                copies_moved += new
                bytes_moved += new * int(per_layer_bytes[layer])
    return Placement(assignment, gpu_load, float(ratios.max()), bytes_moved, copies_moved)
