"""CPU reference twins of the CUDA kernels (NumPy), with the same semantics byte for byte.

Everything above the kernels runs on machines without a GPU through these; the parametrised
suite in tests/test_kernels.py runs each kernel and its twin on the same inputs and compares.
"""

from __future__ import annotations

import numpy as np

from gpu_kernels import abi
from gpu_kernels.checksum import chunk_checksum
from gpu_kernels.ring import Ring
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
    src, dst = int(desc["src_region"]), int(desc["dst_region"])
    if src >= abi.MAX_REGIONS or dst >= abi.MAX_REGIONS:
        return abi.Status.BAD_REGION
    s, d = regions[src], regions[dst]
    if (int(s["size"]) == 0 or int(d["size"]) == 0
            or not int(s["flags"]) & abi.RegionFlags.READABLE
            or not int(d["flags"]) & abi.RegionFlags.WRITABLE):
        return abi.Status.BAD_REGION
    length, so, do = int(desc["length"]), int(desc["src_offset"]), int(desc["dst_offset"])
    if (length | so | do | int(desc["position"])) % abi.COPY_ALIGN_BYTES:
        return abi.Status.BAD_ALIGNMENT
    if so + length > int(s["size"]) or do + length > int(d["size"]):
        return abi.Status.OUT_OF_BOUNDS
    return abi.Status.OK


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

def dispatch(hidden: np.ndarray, plan: DispatchPlan) -> np.ndarray:
    """Twin of ``dpu_dispatch_rows``: ``hidden[tokens, d]`` -> ``packed[tokens * top_k, d]``,
    rows grouped by expert as ``plan`` says."""
    return hidden[plan.order // plan.top_k]


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
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


def send_packets(tx: Ring, data: np.ndarray, message_id: int, model: int, layer: int,
                 expert: int) -> int:
    """Twin of ``dpu_send``: publish ``data`` (uint8, length a multiple of 16) as packets on
    ``tx``; returns packets written. Raises BufferError when the ring lacks room for them
    all (the kernel would wait instead)."""
    assert tx.payload is not None, "not a packet ring"
    room = tx.payload.shape[1]
    packets = -(-data.size // room)
    if tx.free_entries() < packets:
        raise BufferError(f"{packets} packets, {tx.free_entries()} free entries")
    for p in range(packets):
        off = p * room
        chunk = data[off:off + room]
        tx.push({"message_id": message_id, "offset": off, "length": chunk.size,
                 "flags": int(abi.PacketFlags.LAST) if off + chunk.size == data.size else 0,
                 "checksum": chunk_checksum(chunk, off), "layer": layer, "expert": expert,
                 "model": model, "total_length": data.size}, payload=chunk)
    return packets


def receive_packets(rx: Ring, dst: np.ndarray) -> tuple[int, int, int]:
    """Consume one message's packets from ``rx`` into ``dst`` (uint8): each packet's checksum
    is verified and its payload written at its offset, never past ``dst``. Returns
    (message id, bytes written, packets refused). Raises BufferError if the message is not
    complete in the ring yet (nothing is consumed then)."""
    assert rx.payload is not None, "not a packet ring"
    written = refused = 0
    message = -1
    while True:
        rec = rx.peek()
        if rec is None:
            raise BufferError("message incomplete in the rx ring")
        i = rx.consumed & (rx.capacity - 1)
        off, length = int(rec["offset"]), int(rec["length"])
        message = int(rec["message_id"])
        last = bool(int(rec["flags"]) & abi.PacketFlags.LAST)
        chunk = rx.payload[i, :length]
        if length > rx.payload.shape[1] or off + length > dst.size or \
                chunk_checksum(chunk, off) != int(rec["checksum"]):
            refused += 1
        else:
            dst[off:off + length] = chunk
            written += length
        rx.advance()
        if last:
            return message, written, refused
