"""CuPy launchers of the MoE helpers, the checksum and the send kernel; each has a twin of the
same name and meaning in :mod:`gpu_kernels.reference`."""

from __future__ import annotations

from typing import Any

import numpy as np

from dpu_offload import abi
from dpu_offload.checksum import finish
from dpu_offload.packets import packet_count
from dpu_offload.ring import Ring
from gpu_kernels import launch
from gpu_kernels.routing import DispatchPlan

cp = launch.cp
THREADS = 256


def _grid(n: int, device_id: int = 0) -> int:
    return max(1, min(n, launch.sm_count(device_id) * 8))


def dispatch(hidden: Any, plan: DispatchPlan, stream: Any = None, out: Any = None) -> Any:
    """``hidden[tokens, d]`` (any dtype, rows a multiple of 16 bytes) -> packed rows
    ``[tokens * top_k, d]`` (into ``out`` when given)."""
    rows = int(plan.order.size)
    row_bytes = hidden.shape[1] * hidden.dtype.itemsize
    if row_bytes % 16:
        raise ValueError(f"rows of {row_bytes} bytes are not a multiple of 16")
    if out is None:
        out = cp.empty((rows, hidden.shape[1]), hidden.dtype)
    k = launch.kernel("moe_ops", "dpu_dispatch_rows")
    k((_grid(rows),), (THREADS,), (cp.ascontiguousarray(hidden), plan.order,
                                   np.int32(plan.top_k), np.int64(rows),
                                   np.int64(row_bytes // 16), out), stream=stream)
    return out


def combine_bf16(expert_out: Any, plan: DispatchPlan, weights: Any, stream: Any = None,
                 out: Any = None) -> Any:
    """bf16 bits ``uint16[tokens*top_k, d]`` x ``float32[tokens, top_k]`` ->
    ``uint16[tokens, d]`` (into ``out`` when given)."""
    tokens, top_k = weights.shape
    d = expert_out.shape[1]
    if d % 8:
        raise ValueError(f"row width {d} is not a multiple of 8 bf16 values")
    if out is None:
        out = cp.empty((tokens, d), cp.uint16)
    k = launch.kernel("moe_ops", "dpu_combine_bf16")
    k((_grid(tokens),), (THREADS,), (cp.ascontiguousarray(expert_out), plan.inverse,
                                     cp.ascontiguousarray(weights, dtype=cp.float32),
                                     np.int32(top_k), np.int64(tokens), np.int64(d // 8), out),
      stream=stream)
    return out


FFN_MAX_ROWS = 8
"""Rows ``swiglu_bf16`` takes in one call (FFN_MAX_ROWS in expert_ffn.cu)."""


def swiglu_bf16(x: Any, gate: Any, up: Any, down: Any, stream: Any = None) -> Any:
    """One expert's SwiGLU FFN for a few rows, fused into two launches (expert_ffn.cu).

    Args:
        x: bf16 bits ``uint16[rows, hidden]``, ``rows <= FFN_MAX_ROWS``.
        gate, up: bf16 bits ``uint16[inter, hidden]``; down: ``uint16[hidden, inter]``;
            C-contiguous, 16-byte aligned (slot tensors are), ``hidden`` and ``inter``
            multiples of 8.

    Returns:
        bf16 bits ``uint16[rows, hidden]``: ``reference.swiglu_bf16`` up to float32 summation
        order.
    """
    rows, hidden = x.shape
    inter = gate.shape[0]
    if not 1 <= rows <= FFN_MAX_ROWS:
        raise ValueError(f"{rows} rows; the fused FFN takes 1 to {FFN_MAX_ROWS}")
    if gate.shape != (inter, hidden) or up.shape != (inter, hidden) \
            or down.shape != (hidden, inter):
        raise ValueError(f"weights {gate.shape}, {up.shape}, {down.shape} do not fit x "
                         f"{x.shape}: want gate, up [inter, {hidden}] and down [{hidden}, inter]")
    if hidden % 8 or inter % 8:
        raise ValueError(f"hidden {hidden} and inter {inter} must be multiples of 8")
    for name, a in (("x", x), ("gate", gate), ("up", up), ("down", down)):
        if a.dtype != cp.uint16 or not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError(f"{name} must be C-contiguous, 16-byte aligned uint16 (bf16 bits)")
    h = cp.empty((rows, inter), cp.float32)
    out = cp.empty((rows, hidden), cp.uint16)
    warps = THREADS // 32
    launch.kernel("expert_ffn", "dpu_ffn_gate_up")(
        (-(-inter // warps),), (THREADS,),
        (x, gate, up, h, np.int32(rows), np.int32(hidden // 8), np.int32(inter)), stream=stream)
    launch.kernel("expert_ffn", "dpu_ffn_down")(
        (-(-hidden // warps),), (THREADS,),
        (h, down, out, np.int32(rows), np.int32(inter // 8), np.int32(hidden)), stream=stream)
    return out


def checksum(data: Any, position: int) -> int:
    """Checksum of a device buffer (length a multiple of 16), as checksum.chunk_checksum."""
    return chunk_checksums(data, position, data.nbytes)[0]


def chunk_checksums(data: Any, position: int, chunk_bytes: int) -> list[int]:
    """Checksums of ``data`` (device, length a multiple of 16) cut into ``chunk_bytes`` chunks
    (the last may be shorter), chunk c placed at ``position + c * chunk_bytes``; one launch.
    Equals ``[chunk_checksum(chunk, its position) for each chunk]``."""
    raw = data.reshape(-1).view(cp.uint8)
    if raw.size % 16 or position % 4 or chunk_bytes % 16 or chunk_bytes <= 0:
        raise ValueError("checksum kernel needs 16-byte multiples and a 4-byte position")
    chunks = -(-raw.size // chunk_bytes)
    out = cp.zeros(chunks, cp.uint32)
    launch_checksums(raw.data.ptr, raw.size, chunk_bytes, position, out.data.ptr)
    return [finish(s, min(chunk_bytes, raw.size - c * chunk_bytes))
            for c, s in enumerate(out.get().tolist())]


def launch_checksums(address: int, nbytes: int, chunk_bytes: int, position: int, out: int,
                     stream: Any = None, blocks_per_chunk: int | None = None) -> None:
    """Enqueue ``dpu_checksum`` over ``nbytes`` at device ``address`` in ``chunk_bytes``
    chunks, adding chunk c's sum of terms into the uint32 at ``out + 4 * c`` (zero it first;
    the word count is not folded in)."""
    n16, chunk_n16 = nbytes // 16, chunk_bytes // 16
    chunks = -(-n16 // chunk_n16)
    grid_x = blocks_per_chunk or max(1, min(chunk_n16 // THREADS,
                                            launch.sm_count(cp.cuda.Device().id) * 8 // chunks))
    launch.kernel("moe_ops", "dpu_checksum")(
        (grid_x, chunks), (THREADS,),
        (np.uint64(address), np.uint64(n16), np.uint64(chunk_n16), np.uint64(position),
         np.uint64(out)), stream=stream)


def send_packets(tx: Ring, tx_device_ptr: int, data: Any, message_id: int, model: int,
                 layer: int, expert: int, stream: Any = None, *, base: int = 0,
                 total: int | None = None, slot: int = 0, status: int = 0,
                 flags: int = 0) -> int:
    """Launch ``dpu_send`` for ``data`` (device uint8, 16-byte multiple), the part of a message
    of ``total`` bytes (default: all of it) that starts ``base`` bytes in, into ``tx`` (a packet
    ring in registered host memory whose device address is ``tx_device_ptr``), as
    ``packet_twin.send_packets`` writes it (``slot``, ``status``, ``flags`` likewise). Returns
    the packets it will publish; the host's producer count advances by that many."""
    packets = packet_count(int(data.size), tx.entry_size)
    first = tx.produced
    total = data.size if total is None else total
    k = launch.kernel("send", "dpu_send")
    k((_grid(packets),), (THREADS,), (np.uint64(tx_device_ptr),
                                      np.uint64(tx_device_ptr + abi.HEADER_BYTES), data,
                                      np.uint64(data.size), np.uint64(first),
                                      np.uint64(message_id), np.uint32(model), np.uint32(layer),
                                      np.uint32(expert), np.uint64(base), np.uint64(total),
                                      np.uint64(slot), np.uint32(status), np.uint32(flags)),
      stream=stream)
    tx.advance_producer(packets)
    return packets


def receive_packets(rx: Ring, rx_device_ptr: int, dst: Any, packets: int,
                    stream: Any = None) -> tuple[int, int, int]:
    """Launch ``dpu_receive_packets`` for the next ``packets`` entries of ``rx`` (a packet ring
    in registered host memory at device address ``rx_device_ptr``) into ``dst`` (device
    uint8), wait for it, and advance the ring's consumer. Returns (message id of the LAST
    packet, bytes written, packets refused), as packet_twin.receive_packets."""
    raw = dst.reshape(-1).view(cp.uint8)
    if raw.data.ptr % 16:
        raise ValueError("dst must be 16-byte aligned")
    out = cp.zeros(3, cp.uint64)
    k = launch.kernel("receive_packets", "dpu_receive_packets")
    k((_grid(packets),), (THREADS,), (np.uint64(rx_device_ptr),
                                      np.uint64(rx_device_ptr + abi.HEADER_BYTES), raw,
                                      np.uint64(raw.size), np.uint64(rx.consumed),
                                      np.uint64(packets), out), stream=stream)
    written, refused, message_id = (int(x) for x in out.get(stream=stream))
    rx.advance(packets)
    return message_id, written, refused


WAIT_OUTCOMES = ("READY", "FAILED", "slot moved to a later generation", "timed out",
                 "LANDED, not checked", "refused by the agent",
                 "the grant names no slot of this device that holds the blob")
"""What the result word of ``wait_ready``, ``verify_landed`` and ``verify_granted_batch`` means
(ready.cu; the last two only from ``verify_granted_batch``)."""


def wait_ready(word_address: int, generation: int, timeout_s: float, result: Any,
               stream: Any) -> None:
    """Enqueue on ``stream`` a wait until the slot-state word at ``word_address`` (a device
    address of registered host memory) reads READY or FAILED for ``generation``; ``result``
    (``uint32[1]`` device array) gets an index into ``WAIT_OUTCOMES``. Twin:
    ``reference.wait_ready``."""
    k = launch.kernel("ready", "dpu_wait_ready")
    k((1,), (32,), (np.uint64(word_address), np.uint64(generation),
                    np.uint64(int(timeout_s * 1e9)), result), stream=stream)


def verify_landed(entry_address: int, generation: int, data: int, nbytes: int,
                  timeout_s: float, result: Any, scratch: Any, stream: Any) -> None:
    """Enqueue on ``stream`` the check of a DMA-engine delivery: wait until the slot-state
    entry at ``entry_address`` (device address of registered host memory) reads LANDED for
    ``generation``, sum the ``nbytes`` (a multiple of 16) at device address ``data`` and publish
    READY, or FAILED with CHECKSUM_MISMATCH, against the entry's ``expected``. ``result``
    (``uint32[1]``) gets an index into ``WAIT_OUTCOMES``; ``scratch`` (``uint32[2]`` device
    words, zero, left zero) must not be in use by another check at the same time. Twin:
    ``reference.verify_landed``."""
    timeout_ns = np.uint64(int(timeout_s * 1e9))
    launch.kernel("ready", "dpu_wait_landed")(
        (1,), (32,), (np.uint64(entry_address), np.uint64(generation), timeout_ns, result),
        stream=stream)
    n16 = nbytes // 16
    launch.kernel("ready", "dpu_verify_landed")(
        (_grid(-(-n16 // THREADS), cp.cuda.Device().id),), (THREADS,),
        (np.uint64(entry_address), np.uint64(generation), np.uint64(data), np.uint64(n16),
         np.uint32(abi.Status.CHECKSUM_MISMATCH), result, scratch), stream=stream)


BATCH_THREADS = 512
"""Threads per block of a batch check."""
MAX_BATCH_CHECKS = 64
"""Slots one batch-check launch takes."""
RESIDENT_BLOCKS_PER_SLOT = 8
"""Blocks per slot of the batch check the client launches (``verify_granted_batch``): they sit
resident from the post until the slot's bytes land (``bench/slot_check.py`` times other
counts)."""
SUM_BLOCKS_PER_SM = 4
"""A batch check that waits first sums with up to this many blocks per multiprocessor (of
``BATCH_THREADS``: as many as a multiprocessor holds at once), spread over the batch's slots."""
MIN_SUM_VECTORS = BATCH_THREADS * 16
"""16-byte vectors each summing block takes at least (128 KiB), so a small slot gets few
blocks."""


CHECK_SCRATCH_WORDS = 10
"""Device words of a batch check's scratch per request (``DPU_CHECK_SCRATCH`` in ready.cu: the
sum, two block counts, the handed outcome and the handed grant, 8-byte aligned when the scratch
is)."""


CHECK_FORMS = ("resident", "batch", "slot")
"""How ``verify_granted_batch`` launches a batch's checks (see there)."""


def verify_granted_batch(checks_address: int, n: int, largest_n16: int, regions: Any,
                         timeout_s: float, results: Any, scratch: Any, stream: Any,
                         form: str = "resident",
                         resident_blocks: int = RESIDENT_BLOCKS_PER_SLOT) -> None:
    """Enqueue on ``stream`` the checks of ``n`` posted ACQUIREs of a DMA-engine device, before
    the agent answered them: each waits for its reply, takes the granted slot from it
    (bounds-checked against ``regions``, the device's ``abi.REGION_DTYPE`` table in device
    memory) and then checks it as :func:`verify_landed` does. ``checks_address`` is the device
    address of ``abi.CHECK_DTYPE[n]`` in mapped host memory (read by the kernels' blocks as they
    start: keep it unchanged until the launches have ended), ``largest_n16`` the largest
    ``n16`` among them (it sizes the grid). ``results`` (``uint32[n]``) get each request's
    outcome (an index into ``WAIT_OUTCOMES``; no verdict unless every block of the slot saw it
    land); ``scratch`` (``uint32[CHECK_SCRATCH_WORDS * n]`` device words, 8-byte aligned, zero,
    left zero) must not be in use by another launch at the same time. Twin:
    ``reference.verify_granted_batch``.

    ``form`` (one of ``CHECK_FORMS``):
    - ``resident``: one launch, at most ``resident_blocks`` blocks per slot (each summing at
      least ``BATCH_THREADS * 64`` vectors), resident from the post: each slot is verified as
      soon as its own bytes land, by those few blocks.
    - ``batch``: two launches: one small block per slot waits, and once every slot of the
      batch landed or ended, the second sums them all with the whole GPU
      (``SUM_BLOCKS_PER_SM`` blocks per multiprocessor, at least ``MIN_SUM_VECTORS`` each):
      the verdicts come together after the last landing.
    - ``slot``: those two launches per slot, in order: each slot is waited for by one small
      block and summed by the whole GPU as soon as it lands (``2 n`` launches).
    In the last two no summing block sits resident beside the inference's kernels while the
    bytes move. ``bench/slot_check.py`` compares the three (docs/PERFORMANCE.md): ``resident``,
    the fastest for a batch, is what the client launches."""
    if form not in CHECK_FORMS:
        raise ValueError(f"check form {form!r}: expected one of {CHECK_FORMS}")
    kernel = launch.kernel("ready", "dpu_verify_granted_batch")
    fixed = (regions, np.uint64(int(timeout_s * 1e9)), np.uint32(abi.Status.CHECKSUM_MISMATCH))
    if form == "resident":
        blocks = max(1, min(resident_blocks, -(-largest_n16 // (BATCH_THREADS * 64))))
        kernel((blocks, n), (BATCH_THREADS,),
               (np.uint64(checks_address), *fixed, results, scratch, np.uint32(0)),
               stream=stream)
        return
    count = n if form == "batch" else 1  # requests a pair of launches takes
    room = -(-launch.sm_count(cp.cuda.Device().id) * SUM_BLOCKS_PER_SM // count)
    blocks = max(1, min(room, -(-largest_n16 // MIN_SUM_VECTORS)))
    for first in range(0, n, count):
        words = scratch[CHECK_SCRATCH_WORDS * first:CHECK_SCRATCH_WORDS * (first + count)]
        args = (np.uint64(checks_address + first * abi.CHECK_DTYPE.itemsize), *fixed,
                results[first:first + count], words)
        kernel((1, count), (32,), (*args, np.uint32(1)), stream=stream)
        kernel((blocks, count), (BATCH_THREADS,), (*args, np.uint32(0)), stream=stream)
