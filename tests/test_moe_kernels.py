"""MoE dispatch/combine, the checksum kernel, the send kernel and the expert FFN against their
twins."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_offload import abi
from dpu_offload.checksum import chunk_checksum
from dpu_offload.ring import Ring
from gpu_kernels import moe_twin, packet_twin, reference
from gpu_kernels.routing import dispatch_plan

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _backend(name: str) -> SimpleNamespace:
    if name == "cpu":
        return SimpleNamespace(xp=np, ops=reference, get=np.asarray)
    cp = pytest.importorskip("cupy")
    from gpu_kernels import cuda_ops

    return SimpleNamespace(xp=cp, ops=cuda_ops, get=cp.asnumpy)


def _routing(tokens: int, experts: int, top_k: int, hidden: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    w = rng.random((tokens, top_k), dtype=np.float32)
    w /= w.sum(1, keepdims=True)
    x = reference.f32_to_bf16(rng.standard_normal((tokens, hidden), dtype=np.float32))
    return ids.astype(np.int32), w, x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens,experts,top_k,hidden", [(1, 4, 1, 8), (37, 16, 4, 64),
                                                         (128, 256, 8, 7168)])
def test_dispatch_then_combine(backend: str, tokens: int, experts: int, top_k: int,
                               hidden: int) -> None:
    b = _backend(backend)
    ids, w, x = _routing(tokens, experts, top_k, hidden, seed=tokens)
    plan = dispatch_plan(b.xp, b.xp.asarray(ids), experts)
    packed = b.get(b.ops.dispatch(b.xp.asarray(x), plan))
    offsets = b.get(plan.offsets)
    # Every expert's rows are exactly the tokens that chose it, in token order.
    for e in range(experts):
        tokens_of_e = [t for t in range(tokens) if e in ids[t]]
        np.testing.assert_array_equal(packed[offsets[e]:offsets[e + 1]], x[tokens_of_e])
    # "Expert compute" = scale rows by (expert + 1); combine must equal the dense formula.
    order = b.get(plan.order)
    scale = (ids.reshape(-1)[order] + 1).astype(np.float32)[:, None]
    outputs = reference.f32_to_bf16(reference.bf16_to_f32(packed) * scale)
    combined = b.get(b.ops.combine_bf16(b.xp.asarray(outputs), plan, b.xp.asarray(w)))
    ref_plan = dispatch_plan(np, ids, experts)
    np.testing.assert_array_equal(combined, reference.combine_bf16(outputs, ref_plan, w))
    dense = sum(w[:, k:k + 1].astype(np.float64)
                * reference.bf16_to_f32(x).astype(np.float64) * (ids[:, k:k + 1] + 1)
                for k in range(top_k))
    got = reference.bf16_to_f32(combined).astype(np.float64)
    assert np.linalg.norm(got - dense) / max(np.linalg.norm(dense), 1e-30) < 1e-2


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 12), experts=st.integers(1, 9), hidden=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_the_compiled_combine_equals_the_twin_bit_for_bit(tokens: int, experts: int,
                                                          hidden: int, seed: int,
                                                          data: st.DataObject) -> None:
    """gpu_kernels.moe_twin.combine_bf16 (the host sender's) against reference.combine_bf16
    on any bf16 bit patterns, denormals and infinities included: the same bits wherever the
    result is a number, NaN wherever the twin's is (NaN payloads may differ)."""
    top_k = data.draw(st.integers(1, experts))
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    w = rng.standard_normal((tokens, top_k)).astype(np.float32)
    outputs = rng.integers(0, 2**16, (tokens * top_k, hidden), dtype=np.uint16)
    plan = dispatch_plan(np, ids, experts)
    with np.errstate(all="ignore"):
        want = reference.combine_bf16(outputs, plan, w)
    got = moe_twin.combine_bf16(outputs, plan, w)
    nan = np.isnan(reference.bf16_to_f32(want))
    np.testing.assert_array_equal(np.isnan(reference.bf16_to_f32(got)), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


def test_the_compiled_combine_refuses_misshapen_outputs() -> None:
    plan = dispatch_plan(np, np.array([[0, 1]]), 2)
    with pytest.raises(ValueError, match=r"uint16\[2, d\]"):
        moe_twin.combine_bf16(np.zeros((3, 4), np.uint16), plan, np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="float32"):
        moe_twin.combine_bf16(np.zeros((2, 4), np.float32), plan, np.ones((1, 2), np.float32))


def test_dispatch_plan_refuses_bad_ids() -> None:
    with pytest.raises(ValueError, match="outside"):
        dispatch_plan(np, np.array([[0, 9]]), 4)
    with pytest.raises(ValueError, match="tokens, top_k"):
        dispatch_plan(np, np.array([1, 2]), 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nbytes,position", [(16, 0), (4096, 256), (1 << 20, 12345 * 16)])
def test_checksum_kernel_matches_definition(backend: str, nbytes: int, position: int) -> None:
    b = _backend(backend)
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    expected = chunk_checksum(data, position)
    got = (chunk_checksum(data, position) if backend == "cpu"
           else b.ops.checksum(b.xp.asarray(data), position))
    assert got == expected



@pytest.mark.gpu
@pytest.mark.parametrize("nbytes,chunk,position", [((3 << 20) + 4096, 1 << 20, 0),
                                                   (4096, 4096, 64), (48, 32, 1 << 20)])
def test_chunk_checksums_one_launch_equals_each_chunk(nbytes: int, chunk: int,
                                                      position: int) -> None:
    b = _backend("cuda")
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    expected = [chunk_checksum(data[c:c + chunk], position + c) for c in range(0, nbytes, chunk)]
    assert b.ops.chunk_checksums(b.xp.asarray(data), position, chunk) == expected

def _decode(tx: Ring, count: int) -> tuple[np.ndarray, list[dict]]:
    consumer = Ring(tx.buffer, abi.RingKind.TX_PACKET)
    total = None
    out, headers = None, []
    for _ in range(count):
        h = consumer.peek()
        assert h is not None
        i = (consumer.consumed) & (consumer.capacity - 1)
        hdr = {k: int(h[k]) for k in abi.PACKET_HEADER_DTYPE.names if k != "seq"}
        payload = consumer.payload[i, :hdr["length"]].copy()
        assert chunk_checksum(payload, hdr["offset"]) == hdr["checksum"]
        if out is None:
            total = hdr["total_length"]
            out = np.zeros(total, np.uint8)
        out[hdr["offset"]:hdr["offset"] + hdr["length"]] = payload
        headers.append(hdr)
        consumer.advance()
    return out, headers


@pytest.mark.parametrize("backend", BACKENDS)
def test_send_packetizes_with_checksums(backend: str) -> None:
    b = _backend(backend)
    entry = 64 + 4096
    data = np.random.default_rng(3).integers(0, 256, 4096 * 5 + 512, dtype=np.uint8)
    buf = np.zeros(abi.ring_bytes(16, entry), np.uint8)
    tx = Ring.format(buf, abi.RingKind.TX_PACKET, 16, entry)
    if backend == "cpu":
        n = packet_twin.send_packets(tx, data, 77, 1, 2, 3)
    else:
        cp = b.xp
        cp.cuda.runtime.hostRegister(buf.ctypes.data, buf.nbytes, 0x1 | 0x2)
        try:
            from host_client.cuda_device import device_pointer

            ptr = device_pointer(buf.ctypes.data)
            n = b.ops.send_packets(tx, ptr, cp.asarray(data), 77, 1, 2, 3)
            cp.cuda.runtime.deviceSynchronize()
        finally:
            cp.cuda.runtime.hostUnregister(buf.ctypes.data)
    assert n == 6
    got, headers = _decode(tx, n)
    np.testing.assert_array_equal(got, data)
    assert [h["flags"] for h in headers] == [0] * 5 + [abi.PacketFlags.LAST]
    assert {(h["message_id"], h["model"], h["layer"], h["expert"]) for h in headers} == {
        (77, 1, 2, 3)}


class PacketRing:
    """A packet ring in host memory, registered with the GPU for the cuda backend; ``receive``
    runs the backend's receive (kernel or twin) into a device buffer with guard bytes."""

    def __init__(self, b: SimpleNamespace, backend: str, capacity: int, entry: int) -> None:
        self.b, self.backend = b, backend
        self.buf = np.zeros(abi.ring_bytes(capacity, entry), np.uint8)
        self.ring = Ring.format(self.buf, abi.RingKind.RX_PACKET, capacity, entry)
        self.ptr = 0
        if backend == "cuda":
            from host_client.cuda_device import device_pointer

            b.xp.cuda.runtime.hostRegister(self.buf.ctypes.data, self.buf.nbytes, 0x1 | 0x2)
            self.ptr = device_pointer(self.buf.ctypes.data)

    def receive(self, size: int, packets: int, guard: int = 64) -> tuple[tuple, np.ndarray]:
        """(message id, written, refused) and the destination's bytes including ``guard``
        0xA5 bytes after it (which must survive)."""
        dst = self.b.xp.full(size + guard, 0xA5, np.uint8)
        dst[:size] = 0
        if self.backend == "cpu":
            got = packet_twin.receive_packets(self.ring, dst[:size])
        else:
            got = self.b.ops.receive_packets(self.ring, self.ptr, dst[:size], packets)
        return got, self.b.get(dst)

    def close(self) -> None:
        if self.backend == "cuda":
            self.b.xp.cuda.runtime.hostUnregister(self.buf.ctypes.data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_receive_packets_verifies_and_bounds(backend: str) -> None:
    b = _backend(backend)
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, 256 * 5 + 48, dtype=np.uint8)
    pr = PacketRing(b, backend, 8, 64 + 256)
    try:
        ring = pr.ring
        assert packet_twin.send_packets(ring, data, 5, 0, 1, 2) == 6
        ring.payload[(ring.consumed + 2) & 7, 3] ^= 0xFF          # corrupt packet 2
        (mid, written, refused), dst = pr.receive(data.size, 6)
        assert (mid, refused, written) == (5, 1, data.size - 256)
        np.testing.assert_array_equal(dst[:512], data[:512])
        assert not dst[512:768].any(), "a corrupted packet was written"
        np.testing.assert_array_equal(dst[768:data.size], data[768:])
        assert (dst[data.size:] == 0xA5).all()
        packet_twin.send_packets(ring, data[:512], 6, 0, 1, 2)
        got, small = pr.receive(304, 2)                           # second packet runs past it
        assert got[1:] == (256, 1) and (small[304:] == 0xA5).all()
        assert ring.consumed == ring.produced
    finally:
        pr.close()
    with pytest.raises(BufferError):
        packet_twin.receive_packets(ring, np.zeros(16, np.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows,hidden,inter", [(1, 256, 192), (3, 2048, 768), (8, 512, 2048)])
def test_swiglu_matches_float64(backend: str, rows: int, hidden: int, inter: int) -> None:
    """The expert FFN (fused kernel on CUDA, array formula as twin) against a float64 oracle:
    equal up to one bf16 rounding step of the output."""
    b = _backend(backend)
    rng = np.random.default_rng(rows)
    x = reference.f32_to_bf16(rng.standard_normal((rows, hidden), dtype=np.float32))
    gate, up = (reference.f32_to_bf16(0.05 * rng.standard_normal((inter, hidden),
                                                                  dtype=np.float32))
                for _ in range(2))
    down = reference.f32_to_bf16(0.05 * rng.standard_normal((hidden, inter), dtype=np.float32))
    wide = [reference.bf16_to_f32(a).astype(np.float64) for a in (x, gate, up, down)]
    g, u = wide[0] @ wide[1].T, wide[0] @ wide[2].T
    want = (g / (1 + np.exp(-g)) * u) @ wide[3].T
    got = b.get(b.ops.swiglu_bf16(*(b.xp.asarray(a) for a in (x, gate, up, down))))
    assert got.shape == (rows, hidden) and got.dtype == np.uint16
    np.testing.assert_allclose(reference.bf16_to_f32(got), want, rtol=1 / 64,
                               atol=1e-3 * np.abs(want).max())


@pytest.mark.gpu
def test_fused_swiglu_refuses_what_it_cannot_take() -> None:
    cp = pytest.importorskip("cupy")
    from gpu_kernels import cuda_ops

    w = cp.zeros((64, 64), cp.uint16)
    with pytest.raises(ValueError, match="rows"):
        cuda_ops.swiglu_bf16(cp.zeros((cuda_ops.FFN_MAX_ROWS + 1, 64), cp.uint16), w, w, w)
    with pytest.raises(ValueError, match="do not fit"):
        cuda_ops.swiglu_bf16(cp.zeros((1, 64), cp.uint16), w, w, cp.zeros((64, 32), cp.uint16))
    with pytest.raises(ValueError, match="aligned"):
        cuda_ops.swiglu_bf16(cp.zeros(72, cp.uint16)[4:68].reshape(1, 64), w, w, w)
