"""Zero-copy torch views of a device's slot pool, one per expert parameter: the pool lays
experts out at a fixed stride, so each parameter of an expert blob (its offset, shape and dtype
from the model's manifest: every expert of a model has the same) is one ``[slots, ...]``
strided view over the whole pool. Slot ``s`` of a view is the parameter of the expert in slot
``s``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpu_offload.v1 import agent_pb2 as pb
from host_client.integrations.moe_modules import OffloadError
from host_client.memory import TORCH_DTYPES, SlotPoolSpec, tensor_layout
from host_client.registration import AttachedDevice

MAX_GROUPS = 1023
"""The most slots one experts forward spans: an experts implementation computes over a view's
``[slots, ...]`` as groups, and torch's grouped GEMM on Hopper and Blackwell (``grouped_mm``,
CUTLASS) refuses 1,024 groups or more."""


@dataclass(frozen=True)
class Window:
    """A run of ``count`` consecutive slots from ``first``, and the views of its slots
    (``[count, ...]``, zero-copy)."""

    first: int
    count: int
    tensors: dict[str, Any]

    def holds(self, slots: np.ndarray) -> np.ndarray:
        """``bool[...]``: which of ``slots`` (slot numbers in the pool) lie in this window."""
        return (slots >= self.first) & (slots < self.first + self.count)


@dataclass
class PoolViews:
    """Zero-copy ``[slots, ...]`` views of the pool, one per expert parameter."""

    tensors: dict[str, Any]
    slots: int
    slot_bytes: int
    home_layers: tuple[int, ...] = ()
    """The pool's homes (``SlotPoolSpec.home_layers``; empty: none)."""

    @property
    def on_gpu(self) -> bool:
        """Whether the pool is CUDA memory (its experts can be awaited on a stream)."""
        return next(iter(self.tensors.values())).is_cuda

    def home(self, layer: int) -> Window | None:
        """The run of slots kept for ``layer``'s experts, with its views; None where the pool
        has no home for it (or one of more than ``MAX_GROUPS`` slots)."""
        if layer not in self.home_layers:
            return None
        size = self.slots // len(self.home_layers)
        if size > MAX_GROUPS:
            return None
        return self._window(self.home_layers.index(layer) * size, size)

    def windows(self, limit: int = MAX_GROUPS) -> list[Window]:
        """The pool cut into the fewest runs of consecutive slots of at most ``limit`` each,
        near-equal in size (one run, the whole pool, where it fits)."""
        runs = math.ceil(self.slots / limit)
        size = math.ceil(self.slots / runs)
        return [self._window(first, min(size, self.slots - first))
                for first in range(0, self.slots, size)]

    def _window(self, first: int, count: int) -> Window:
        return Window(first, count, {p: t[first:first + count] for p, t in self.tensors.items()})


def _torch_pool(dev: AttachedDevice, region_id: int, spec: SlotPoolSpec) -> Any:
    import torch

    return torch.from_dlpack(dev.device.region_bytes(region_id, 0,
                                                     spec.slot_bytes * spec.slot_count))


def pool_views(dev: AttachedDevice, manifest: pb.ExpertManifest, wanted: list[str]) -> PoolViews:
    """Views of the device's one slot pool for the parameters ``wanted``, from an expert's
    manifest (every expert of a model has the same roles, shapes and offsets)."""
    import torch

    if len(dev.pools) != 1:
        raise OffloadError(f"offload_experts needs a device with one slot pool, it has "
                           f"{len(dev.pools)}")
    (region_id, spec), = dev.pools.items()
    pool = _torch_pool(dev, region_id, spec)
    out = {}
    for param in wanted:
        try:
            t = tensor_layout(manifest, param)
        except KeyError as exc:
            raise OffloadError(f"the experts module has {param!r}: {exc.args[0]}") from None
        shape, offset, dtype = list(t.shape), t.offset, t.dtype
        if dtype not in TORCH_DTYPES:
            raise OffloadError(f"{manifest.key}: {param} is {dtype}, which torch cannot view")
        typed = pool.view(getattr(torch, TORCH_DTYPES[dtype]))
        size = typed.element_size()
        inner = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            inner[d] = inner[d + 1] * shape[d + 1]
        out[param] = typed.as_strided((spec.slot_count, *shape),
                                      (spec.slot_bytes // size, *inner), offset // size)
    return PoolViews(out, spec.slot_count, spec.slot_bytes, tuple(spec.home_layers))
