"""CPU reference twins of the CUDA kernels (NumPy), with the same semantics byte for byte.

Everything above the kernels runs on machines without a GPU through these; the parametrised
suite in tests/test_kernels.py runs each kernel and its twin on the same inputs and compares.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from dpu_offload import abi, futex
from dpu_offload.channel import Channel, state_word
from dpu_offload.checksum import chunk_checksum, terms_sum
from dpu_offload.ring import Ring, store_fence
from gpu_kernels.routing import DispatchPlan


def check_descriptor(desc: np.void, regions: np.ndarray) -> abi.Status:
    """Validate one descriptor against the region table, before any byte moves.

    Args:
        desc: a ``DESCRIPTOR_DTYPE`` record.
        regions: ``REGION_DTYPE[MAX_REGIONS]`` table.

    Returns:
        OK when the descriptor may execute, else the error status it completes with.
    """
    op = int(desc["opcode"])
    if op in (abi.Opcode.NOP, abi.Opcode.FENCE, abi.Opcode.EXIT):
        return abi.Status.OK
    if op != abi.Opcode.COPY:
        return abi.Status.BAD_OPCODE
    return check_copy(regions, int(desc["src_region"]), int(desc["src_offset"]),
                      int(desc["dst_region"]), int(desc["dst_offset"]), int(desc["length"]),
                      int(desc["position"]))


def check_copy(regions: np.ndarray, src: int, so: int, dst: int, do: int, length: int,
               position: int) -> abi.Status:
    """A COPY's checks on plain ints: ``length`` bytes from (region ``src``, offset ``so``) to
    (``dst``, ``do``) at ``position`` in its object, against ``regions``
    (``REGION_DTYPE[MAX_REGIONS]``). BAD_REGION, then BAD_ALIGNMENT, then OUT_OF_BOUNDS."""
    if src >= abi.MAX_REGIONS or dst >= abi.MAX_REGIONS:
        return abi.Status.BAD_REGION
    _, s_size, s_flags, _ = regions[src].tolist()
    _, d_size, d_flags, _ = regions[dst].tolist()
    if not (s_size and d_size and s_flags & abi.RegionFlags.READABLE
            and d_flags & abi.RegionFlags.WRITABLE):
        return abi.Status.BAD_REGION
    if (length | so | do | position) % abi.COPY_ALIGN_BYTES:
        return abi.Status.BAD_ALIGNMENT
    if so + length > s_size or do + length > d_size:
        return abi.Status.OUT_OF_BOUNDS
    return abi.Status.OK


_CONTROL_OPS = np.array([abi.Opcode.NOP, abi.Opcode.FENCE, abi.Opcode.EXIT], np.uint16)


def check_descriptors(batch: np.ndarray, regions: np.ndarray) -> np.ndarray:
    """``check_descriptor`` over a whole batch at once (same statuses, same precedence).

    Args:
        batch: ``DESCRIPTOR_DTYPE[n]``.
        regions: ``REGION_DTYPE[MAX_REGIONS]`` table.

    Returns:
        ``uint32[n]``: each descriptor's status (0 is OK).
    """
    op = batch["opcode"]
    src, dst = batch["src_region"], batch["dst_region"]
    known = (src < abi.MAX_REGIONS) & (dst < abi.MAX_REGIONS)
    if not known.all():
        src, dst = np.where(known, src, 0), np.where(known, dst, 0)
    size, flags = regions["size"], regions["flags"]
    s_size, d_size = size[src], size[dst]
    usable = (known & (s_size > 0) & (d_size > 0)
              & ((flags[src] & int(abi.RegionFlags.READABLE)) != 0)
              & ((flags[dst] & int(abi.RegionFlags.WRITABLE)) != 0))
    length = batch["length"].astype(np.uint64)
    so, do = batch["src_offset"], batch["dst_offset"]
    aligned = ((length | so | do | batch["position"]) % abi.COPY_ALIGN_BYTES) == 0
    # Written as subtractions so that offsets near 2**64 cannot wrap past the size.
    inside = ((so <= s_size) & (length <= s_size - so)
              & (do <= d_size) & (length <= d_size - do))
    copy = op == int(abi.Opcode.COPY)
    status = np.zeros(batch.size, np.uint32)
    if (usable & aligned & inside & copy).all():
        return status
    # Later assignments take precedence, as in check_descriptor.
    status[~inside] = int(abi.Status.OUT_OF_BOUNDS)
    status[~aligned] = int(abi.Status.BAD_ALIGNMENT)
    status[~usable] = int(abi.Status.BAD_REGION)
    status[~copy] = int(abi.Status.BAD_OPCODE)
    control = op == int(abi.Opcode.NOP)
    for code in _CONTROL_OPS[1:].tolist():  # np.isin sorts: slower than two comparisons
        control |= op == code
    status[control] = 0
    return status


class ReceiveKernel:
    """Twin of ``dpu_receive`` (receive.cu): consumes a work ring, moves bytes between regions,
    verifies chunk checksums and publishes one completion per descriptor.

    Args:
        work: the work ring (this object is its consumer).
        completion: the completion ring (this object is its producer).
        regions: ``REGION_DTYPE[MAX_REGIONS]`` table, read at every descriptor.
        memory: region id -> ``uint8`` array holding that region's bytes here (the CPU twin's
            stand-in for the device addresses in ``regions["base"]``).
    """

    def __init__(self, work: Ring, completion: Ring, regions: np.ndarray,
                 memory: dict[int, np.ndarray]) -> None:
        self.work = work
        self.completion = completion
        self.regions = regions
        self.memory = memory

    def execute(self, desc: np.void) -> tuple[abi.Status, int]:
        """Run one descriptor; returns (status, bytes written)."""
        status = check_descriptor(desc, self.regions)
        if status != abi.Status.OK or int(desc["opcode"]) != abi.Opcode.COPY:
            if int(desc["opcode"]) == abi.Opcode.EXIT and status == abi.Status.OK:
                self.work.request_exit()
            return status, 0
        length = int(desc["length"])
        src = self.memory[int(desc["src_region"])]
        dst = self.memory[int(desc["dst_region"])]
        so, do = int(desc["src_offset"]), int(desc["dst_offset"])
        chunk = src[so : so + length]
        dst[do : do + length] = chunk
        if int(desc["flags"]) & abi.DescriptorFlags.VERIFY:
            got = chunk_checksum(dst[do : do + length], int(desc["position"]))
            if got != int(desc["checksum"]):
                return abi.Status.CHECKSUM_MISMATCH, length
        return abi.Status.OK, length

    def poll(self) -> bool:
        """Consume at most one descriptor. False when nothing was published or the completion
        ring is full (the descriptor then stays in the work ring: back-pressure)."""
        if self.completion.free_entries() <= 0:
            return False
        desc = self.work.peek()
        if desc is None:
            return False
        desc = desc.copy()
        self.work.advance()
        status, nbytes = self.execute(desc)
        self.completion.push({"transfer_id": int(desc["transfer_id"]),
                              "chunk_index": int(desc["chunk_index"]),
                              "status": int(status), "nbytes": nbytes})
        return True

    def drain(self) -> int:
        """Consume everything published so far; returns how many descriptors ran."""
        n = 0
        while self.poll():
            n += 1
        return n


# -- MoE helpers and packets: twins of moe_ops.cu and send.cu ------------------------------

def dispatch(hidden: np.ndarray, plan: DispatchPlan, out: np.ndarray | None = None
             ) -> np.ndarray:
    """Twin of ``dpu_dispatch_rows``: ``hidden[tokens, d]`` -> ``packed[tokens * top_k, d]``,
    rows grouped by expert as ``plan`` says (into ``out`` when given)."""
    return np.take(hidden, plan.order // plan.top_k, axis=0, out=out)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    wide = bits.astype(np.uint32)
    wide <<= np.uint32(16)  # in place: one new array, not two
    return wide.view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32, copy=False).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            ).astype(np.uint16)


def combine_bf16(expert_out: np.ndarray, plan: DispatchPlan, weights: np.ndarray
                 ) -> np.ndarray:
    """Twin of ``dpu_combine_bf16``: ``expert_out`` (bf16 bits, ``uint16[tokens*top_k, d]``)
    weighted by ``weights`` (``float32[tokens, top_k]``) and summed over k in order, in fp32
    without fused multiply-add; returns bf16 bits ``uint16[tokens, d]``."""
    tokens, top_k = weights.shape
    acc = np.zeros((tokens, expert_out.shape[1]), np.float32)
    rows = plan.inverse.reshape(tokens, top_k)
    for k in range(top_k):
        acc += weights[:, k:k + 1].astype(np.float32) * bf16_to_f32(expert_out[rows[:, k]])
    return f32_to_bf16(acc)


def array_module(a: Any) -> Any:
    """numpy, or cupy for a CuPy array (without importing CuPy where there is none)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


class WideSwiglu(NamedTuple):
    """An expert's SwiGLU weights in float32, oriented for ``rows @ weight``: ``gate``, ``up``
    ``[hidden, inter]``, ``down`` ``[inter, hidden]``. :func:`widen_swiglu` lays them out
    contiguously, so that BLAS reads them in storage order (for a few rows about twice as fast
    as through a transposed view); :func:`swiglu_bf16` passes views."""

    gate: Any
    up: Any
    down: Any


def widen_swiglu(gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> WideSwiglu:
    """Checkpoint-layout bf16 weights (``uint16``: gate, up ``[inter, hidden]``, down
    ``[hidden, inter]``; NumPy or CuPy) widened once, for an expert computed many times
    (transposed while 16-bit: half the bytes through the strided copy, about twice as fast)."""
    xp = array_module(gate)
    return WideSwiglu(*(bf16_to_f32(xp.ascontiguousarray(w.T)) for w in (gate, up, down)))


def swiglu_wide(x: np.ndarray, w: WideSwiglu) -> np.ndarray:
    """:func:`swiglu_bf16` with widened weights: ``uint16[rows, hidden]`` bf16 bits in and
    out."""
    xf = bf16_to_f32(x)
    g = xf @ w.gate
    u = xf @ w.up
    h = (g / (1.0 + array_module(g).exp(-g))) * u
    return f32_to_bf16(h @ w.down)


def swiglu_bf16(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray
                ) -> np.ndarray:
    """``down @ (silu(gate @ x) * (up @ x))`` per row; bf16 bits in and out, fp32 math; NumPy
    or CuPy arrays (all of one kind).

    Args:
        x: ``uint16[rows, hidden]``; gate, up: ``uint16[inter, hidden]``; down:
            ``uint16[hidden, inter]``.
    """
    return swiglu_wide(x, WideSwiglu(*(bf16_to_f32(w).T for w in (gate, up, down))))


def _poll_word(words: np.ndarray, index: int, generation: int, timeout_s: float,
               stop_at_landed: bool) -> int:
    deadline = time.monotonic() + timeout_s
    pause = 0.0  # backs off to 0.5 ms, as the kernel's __nanosleep backs off
    while True:
        w = int(words[index])
        gen, state = w >> abi.SLOT_STATE_BITS, w & ((1 << abi.SLOT_STATE_BITS) - 1)
        if gen == generation and state in (abi.SlotState.READY, abi.SlotState.FAILED):
            return 0 if state == abi.SlotState.READY else 1
        if gen == generation and state == abi.SlotState.LANDED and stop_at_landed:
            return 4
        if gen > generation:
            return 2
        if time.monotonic() > deadline:
            return 3
        time.sleep(pause)
        pause = min(5e-4, 2 * pause or 1e-5)


def wait_ready(words: np.ndarray, index: int, generation: int, timeout_s: float) -> int:
    """Twin of ``dpu_wait_ready``: poll ``words[index]`` (the slot-state table) until READY or
    FAILED for ``generation``; returns 0 READY, 1 FAILED, 2 a later generation, 3 timed out."""
    return _poll_word(words, index, generation, timeout_s, False)


def verify_landed(states: np.ndarray, index: int, generation: int, blob: np.ndarray,
                  timeout_s: float) -> int:
    """Twin of ``cuda_ops.verify_landed``: wait until ``states[index]`` (``SLOT_STATE_DTYPE``
    entries) reads LANDED for ``generation``, then check ``blob`` (``uint8[nbytes]``, the slot's
    bytes) against the entry's ``expected`` and publish READY, or FAILED with
    CHECKSUM_MISMATCH, unless the word moved on meanwhile (2, nothing published). Returns the
    outcome (an index into ``cuda_ops.WAIT_OUTCOMES``). Unlike the kernel, the twin then wakes
    the word's sleepers (a futex wake: a thread can, a GPU kernel cannot), so a waiter of the
    CPU reference device sleeps through the check instead of polling beside it."""
    outcome = _poll_word(states["word"], index, generation, timeout_s, True)
    if outcome != 4:
        return outcome
    entry = states[index:index + 1]
    ok = terms_sum(blob) == int(entry["expected"][0])
    if int(entry["word"][0]) != state_word(generation, abi.SlotState.LANDED):
        return 2  # the slot went to another delivery while it was summed
    if not ok:
        entry["status"] = int(abi.Status.CHECKSUM_MISMATCH)
    store_fence()
    entry["word"] = state_word(generation, abi.SlotState.READY if ok else abi.SlotState.FAILED)
    futex.wake(entry["word"].ctypes.data)
    return 0 if ok else 1


def resolve_grant(reply: np.void, regions: np.ndarray, nbytes: int) -> int:
    """Twin of ``dpu_resolve_grant`` for a reply that has come (``REPLY_DTYPE``): 0 when it
    grants a slot of a registered region (``regions``: the device's ``REGION_DTYPE`` table)
    that holds ``nbytes`` and a slot-state index inside the table, 5 when the agent refused the
    request, 6 otherwise."""
    if int(reply["status"]):
        return 5
    region, offset = int(reply["region_id"]), int(reply["slot_offset"])
    if region >= abi.MAX_REGIONS or int(reply["state_index"]) >= abi.MAX_CHANNEL_SLOTS:
        return 6
    size = int(regions[region]["size"])
    return 0 if size and offset <= size and nbytes <= size - offset else 6


def verify_granted_batch(channel: Channel, regions: np.ndarray,
                         blob_of: Callable[[int, int, int], np.ndarray],
                         checks: list[tuple[int, int]], timeout_s: float) -> list[int]:
    """Twin of ``cuda_ops.verify_granted_batch``, started when the ACQUIREs were posted: for
    each ``(ring position, blob bytes)``, in order, wait for the reply on ``channel``, take the
    slot it grants (:func:`resolve_grant`; ``blob_of(region, offset, nbytes)`` is its bytes) and
    :func:`verify_landed` it, all within ``timeout_s`` of the call; returns the outcomes (an
    index into ``cuda_ops.WAIT_OUTCOMES``)."""
    deadline = time.monotonic() + timeout_s
    outcomes = []
    for position, nbytes in checks:
        pause, reply = 0.0, channel.reply_at(position)
        while reply is None and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(5e-4, 2 * pause or 1e-5)
            reply = channel.reply_at(position)
        if reply is None:
            outcomes.append(3)
            continue
        outcome = resolve_grant(reply, regions, nbytes)
        if outcome == 0:
            blob = blob_of(int(reply["region_id"]), int(reply["slot_offset"]), nbytes)
            outcome = verify_landed(channel.states, int(reply["state_index"]),
                                    int(reply["generation"]), blob,
                                    max(0.0, deadline - time.monotonic()))
        outcomes.append(outcome)
    return outcomes
