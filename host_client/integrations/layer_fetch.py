"""One MoE layer's routed experts through the agent, for an inference framework's layer
forward: acquire them in one batch, compute on zero-copy views of the slot pool, release them
once the device has read them (:func:`through_agent`), and what an offload has done
(:class:`ExpertOffload`).

By default the host waits for every expert's verified bytes before the layer's kernels are
launched. With ``gpu_waits`` on a CUDA pool the host waits only for the grants: the layer's
kernels are enqueued on the torch stream behind GPU-side waits on each expert's bytes
(``AcquireHandle.enqueue_wait``), so they are launched while the experts land, and the host
waits once, for the layer's result, before the release (its GPU tests pass with the DMA
engine; off by default until a benchmark tells it from host waits). The CPU reference device
always waits on the host.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpu_offload.keys import ExpertKey
from host_client.client import AgentClient
from host_client.errors import TransferFailed
from host_client.handles import AcquireHandle
from host_client.integrations.pool_views import PoolViews
from host_client.registration import AttachedDevice
from host_client.slot_checks import StreamWait


@dataclass
class ExpertOffload:
    """What ``offload_experts`` set up, and what it has done.

    A layer's experts are released once the device has read them: at once where the host
    waited for that anyway (a delivery checked behind a stream wait, or the CPU reference
    device), otherwise when the next layer's experts are acquired (its routing, copied to the
    host, has seen the device past them) or at :meth:`settle`. So at most one layer's experts
    stay held between forwards, and no layer waits on the host for its own kernels.

    Attributes:
        model: the agent's name for the checkpoint.
        device: the device the experts are delivered to.
        layers: layer -> the offloaded experts module.
    """

    client: AgentClient
    model: str
    device: AttachedDevice
    layers: dict[int, Any] = field(default_factory=dict)
    forwards: int = 0
    experts_acquired: int = 0
    hits: int = 0
    """Acquires that started no delivery (the expert was in its slot, or on its way there)."""
    prefetched: int = 0
    """Experts prefetched for the next MoE layer (``prefetch=True``)."""
    prefetch_used: int = 0
    """Of those, the ones the next layer's router then chose."""
    stream_retries: int = 0
    """Layers computed again, the host waiting, after a delivery behind a stream wait failed
    its check (CUDA pools)."""
    gpu_waits: bool = False
    """On a CUDA pool, each layer's kernels wait for its experts' bytes on the GPU (stream
    waits) rather than the host waiting for them (``offload_experts(gpu_waits=...)``)."""
    report_routing: bool = True
    """Each MoE layer's routing goes to the agent (``report_routing``)."""
    visits_reported: int = 0
    """Layer visits reported (the client's ``visits_refused`` counts refusals)."""
    held: list[tuple[Any, list[ExpertKey]]] = field(default_factory=list)
    """Experts computed on but not yet released: (a CUDA event recorded after the kernels
    that read them, their keys)."""

    def settle(self) -> None:
        """Release the experts still held (waiting for the device to have read them)."""
        while self.held:
            read, keys = self.held.pop(0)
            read.synchronize()
            self.client.release_batch(self.device, keys)


SMALL_ROUTING = 96
"""Routed ids up to which a layer's routing is counted in a list (a decode step's few: 3 us
against NumPy's 12 at 8 ids on the VM, the same at 64); past it, by ``np.unique``."""


def routed_experts(indices: Any, num_experts: int) -> dict[int, int]:
    """The distinct experts of ``indices`` (a layer's routing, a torch tensor of any shape on
    any device) -> how many tokens chose each, in expert order. One copy to the host (on a
    GPU, the layer's one wait for its router), counted there: ``torch.unique`` on the GPU
    would cost its kernels and two more waits."""
    flat = indices.detach().reshape(-1)
    if flat.numel() <= SMALL_ROUTING:
        tokens = Counter(flat.tolist())
        return {e: tokens[e] for e in sorted(tokens) if 0 <= e < num_experts}
    experts, counts = np.unique(flat.cpu().numpy(), return_counts=True)
    return {e: n for e, n in zip(experts.tolist(), counts.tolist(), strict=True)
            if 0 <= e < num_experts}


@dataclass
class Acquired:
    """A layer's routed experts, granted: ``keys`` to release, ``slot_of``
    (``int64[num_experts + 1]``: each routed expert's slot number in the pool,
    ``views.slots`` for the others) and, where the experts are awaited on the GPU, the
    ``waits`` on the stream the layer computes on (their bytes may still be landing)."""

    keys: list[ExpertKey]
    slot_of: np.ndarray
    waits: list[StreamWait]


def acquire_layer(offload: ExpertOffload, layer: int, routed: dict[int, int],
                  views: PoolViews, num_experts: int, meanwhile: Callable[[], None] | None,
                  on_stream: bool, again: bool = False) -> Acquired:
    """Acquire the ``routed`` experts of ``layer`` (expert -> tokens that chose it) in one
    batch, running ``meanwhile`` once it is posted. ``on_stream`` (a CUDA pool): only the
    grants are awaited, and the torch stream waits on the GPU for each expert's verified
    bytes, so the layer's kernels are enqueued while the experts land; otherwise the host waits
    for them. With ``report_routing`` the visit is reported once the batch is posted (ROUTE
    entries on the device's channel, not waking the agent: it folds the visit at its next
    wake, off the grants' path). ``again``: the layer acquired a second time after a failed
    delivery, which reports and runs ``meanwhile`` no second time."""

    client = offload.client
    keys = [ExpertKey(offload.model, layer, e) for e in routed]
    handles = client.acquire_batch(offload.device, keys, wait=not on_stream)
    if not again:
        if offload.report_routing and routed:
            client.report_visit(offload.device, offload.model, layer, routed)
            offload.visits_reported += 1
        if meanwhile is not None:
            meanwhile()
    waits: list[StreamWait] = []
    if on_stream:
        try:
            waits = _stream_waits(handles, next(iter(views.tensors.values())).device)
        except BaseException:
            client.release_granted(offload.device, handles)
            raise
    else:
        client.wait_all(handles, 120)
    slot_of = _slot_numbers(offload, list(routed), handles, views, num_experts)
    offload.forwards += 1
    offload.experts_acquired += len(keys)
    return Acquired(keys, slot_of, waits)


@functools.lru_cache(maxsize=8)
def _cupy_stream(ptr: int, device_index: int) -> Any:
    """The CuPy view of the CUDA stream at ``ptr`` (0: the legacy default stream)."""
    from gpu_kernels.launch import cp

    return cp.cuda.ExternalStream(ptr, device_index) if ptr else cp.cuda.Stream.null


def _stream_waits(handles: list[AcquireHandle], device: Any) -> list[StreamWait]:
    """Each handle's wait for its expert's verified bytes, enqueued on torch's current stream
    of ``device`` (the pool's CUDA device)."""
    import torch

    from gpu_kernels.launch import cp

    stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cp.cuda.Device(device.index):
        return [h.enqueue_wait(stream, 120) for h in handles]


def _slot_numbers(offload: ExpertOffload, routed: list[int], handles: list[AcquireHandle],
                  views: PoolViews, num_experts: int) -> np.ndarray:
    """``int64[num_experts + 1]``: each routed expert's granted slot, ``views.slots`` for the
    others; counts the hits."""
    slots = np.full(num_experts + 1, views.slots, np.int64)
    for e, h in zip(routed, handles, strict=True):
        where = h.where
        assert where is not None
        slots[e] = where[1] // views.slot_bytes
        offload.hits += bool(h.resident)
    return slots


def _synchronize(out: Any) -> None:
    """Wait for the kernels that read the slots before the experts are released."""
    import torch

    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()


def _read_event(out: Any) -> Any:
    """A CUDA event recorded on the current stream of ``out``'s device: it completes once
    the kernels enqueued so far (those that read the slots) have run."""
    import torch

    read = torch.cuda.Event()
    read.record(torch.cuda.current_stream(out.device))
    return read


def through_agent(offload: ExpertOffload, layer: int, routed: dict[int, int],
                  views: PoolViews, num_experts: int, compute: Callable[[Any], Any],
                  meanwhile: Callable[[], None] | None = None) -> Any:
    """``compute(slot_of)`` (see :class:`Acquired`) with the ``routed`` experts of ``layer``
    acquired, then released once the device has finished reading them. With ``gpu_waits`` on
    a GPU the layer's kernels are enqueued behind stream waits on its experts' bytes; if a
    delivery failed its check there (the kernels read unverified bytes), the layer is
    acquired again, the host waiting this time (the agent refetches a mismatched expert), and
    computed again. Where every expert was verified before the kernels were enqueued, the
    experts stay held until the next layer's acquire (``ExpertOffload.held``)."""
    offload.settle()
    on_stream, again = offload.gpu_waits and views.on_gpu, False
    while True:
        got = acquire_layer(offload, layer, routed, views, num_experts, meanwhile, on_stream,
                            again)
        held = False
        try:
            out = compute(got.slot_of)
            if out.is_cuda and all(wait.settled for wait in got.waits):
                offload.held.append((_read_event(out), got.keys))
                held = True
                return out
            _synchronize(out)
            for wait in got.waits:
                wait.check()
            return out
        except TransferFailed:
            if not got.waits:
                raise
            offload.stream_retries += 1
            on_stream, again = False, True
        finally:
            if not held:
                for wait in got.waits:  # each settled once, its host word given back
                    with contextlib.suppress(TransferFailed):
                        wait.check()
                offload.client.release_batch(offload.device, got.keys)
