"""Routing bookkeeping shared by the MoE kernels and their twins, written once for any array
module (NumPy or CuPy): which packed row serves which (token, k)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DispatchPlan:
    """Expert-major packing of ``tokens x top_k`` assignments.

    Attributes:
        order: ``int64[tokens * top_k]``; packed row r holds assignment ``order[r]``
            (= token * top_k + k). Stable: within an expert, token order is kept.
        inverse: ``int64[tokens * top_k]``; assignment a sits in packed row ``inverse[a]``.
        offsets: ``int64[num_experts + 1]``; expert e owns packed rows
            ``offsets[e]:offsets[e + 1]``.
    """

    order: Any
    inverse: Any
    offsets: Any
    top_k: int


def dispatch_plan(xp: Any, topk_ids: Any, num_experts: int) -> DispatchPlan:
    """Plan from ``topk_ids`` (``int[tokens, top_k]``, values in ``[0, num_experts)``)."""
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {topk_ids.shape}")
    flat = topk_ids.reshape(-1).astype(xp.int64)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_ids hold experts outside [0, {num_experts})")
    n = flat.size
    order = xp.argsort(flat * n + xp.arange(n, dtype=xp.int64))
    inverse = xp.empty_like(order)
    inverse[order] = xp.arange(n, dtype=xp.int64)
    counts = xp.bincount(flat, minlength=num_experts)
    offsets = xp.concatenate([xp.zeros(1, xp.int64), xp.cumsum(counts).astype(xp.int64)])
    return DispatchPlan(order, inverse, offsets, int(topk_ids.shape[1]))
