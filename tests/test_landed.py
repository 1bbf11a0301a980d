"""The check of a slot the DMA engine filled (state LANDED): the blob's expected sum from its
chunk checksums, the NumPy twin that publishes READY or FAILED, and the CUDA kernels against
the twin (same outcomes, same slot-state bytes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_kernels import abi, reference
from gpu_kernels.channel import split_word, state_word
from gpu_kernels.checksum import blob_checksums, blob_sum, terms_sum

S = abi.SlotState


@given(st.integers(1, 600), st.integers(1, 64), st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_blob_sum_of_chunk_checksums_is_the_sum_over_the_blob(n16: int, chunk16: int,
                                                               seed: int) -> None:
    blob = np.random.default_rng(seed).integers(0, 256, 16 * n16, dtype=np.uint8)
    chunk = 16 * chunk16
    assert blob_sum(blob_checksums(blob, chunk), blob.size, chunk) == terms_sum(blob)


def _states(generation: int, state: abi.SlotState, expected: int, index: int = 3
            ) -> np.ndarray:
    states = np.zeros(8, abi.SLOT_STATE_DTYPE)
    states[index] = (state_word(generation, state), 0, expected)
    return states


CASES = [  # (state, generation in the table, corrupt a byte) -> outcome
    (S.LANDED, 5, False, 0), (S.LANDED, 5, True, 1), (S.LANDED, 6, False, 2),
    (S.FILLING, 5, False, 3), (S.READY, 5, False, 0), (S.FAILED, 5, False, 1)]


@pytest.mark.parametrize("state,generation,corrupt,outcome", CASES)
def test_twin_publishes_the_verdict_for_its_generation_only(
        state: abi.SlotState, generation: int, corrupt: bool, outcome: int) -> None:
    blob = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    states = _states(generation, state, terms_sum(blob))
    before = states.copy()
    if corrupt:
        blob[777] ^= 0x10
    assert reference.verify_landed(states, 3, 5, blob, timeout_s=0.01) == outcome
    if state == S.LANDED and generation == 5:
        assert split_word(int(states["word"][3])) == (5, S.FAILED if corrupt else S.READY)
        assert states["status"][3] == (abi.Status.CHECKSUM_MISMATCH if corrupt else 0)
        assert states["expected"][3] == before["expected"][3]
    else:
        assert states.tobytes() == before.tobytes(), "nothing is written but a verdict"
    others = np.delete(np.arange(8), 3)
    assert states[others].tobytes() == before[others].tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("state,generation,corrupt,outcome", CASES)
@pytest.mark.parametrize("nbytes", [16, 4096, 3 << 20])
def test_cuda_check_matches_the_twin(state: abi.SlotState, generation: int, corrupt: bool,
                                     outcome: int, nbytes: int) -> None:
    import cupy as cp

    from gpu_kernels import cuda_ops
    from host_client.cuda_device import device_pointer

    blob = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    states = _states(generation, state, terms_sum(blob))
    twin_states = states.copy()
    if corrupt:
        blob[nbytes // 3] ^= 0x01
    want = reference.verify_landed(twin_states, 3, 5, blob, timeout_s=0.01)
    cp.cuda.runtime.hostRegister(states.ctypes.data, states.nbytes, 0x1 | 0x2)
    try:
        result = cp.full(1, 0xFFFFFFFF, cp.uint32)
        scratch = cp.zeros(2, cp.uint32)
        stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()  # the fills above ran on the null stream, which a
        # non-blocking stream does not wait for (a sanitizer's slowness once showed it)
        entry = device_pointer(states.ctypes.data) + 3 * abi.SLOT_STATE_DTYPE.itemsize
        on_gpu = cp.asarray(blob)
        cuda_ops.verify_landed(entry, 5, int(on_gpu.data.ptr), nbytes, 0.01, result, scratch,
                               stream)
        stream.synchronize()
        assert int(result.get()[0]) == want == outcome
        assert states.tobytes() == twin_states.tobytes()
        assert not scratch.get().any(), "the scratch words are left zero for the next check"
    finally:
        cp.cuda.runtime.hostUnregister(states.ctypes.data)


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [16, 4096, 3 << 20])
def test_cuda_batch_check_matches_the_twin(nbytes: int) -> None:
    """One launch checks every case of ``CASES`` at once, a slot each (and one slot twice as
    many times the size): each slot's outcome and slot-state bytes are the twin's; the
    scratch is left zero."""
    import cupy as cp

    from gpu_kernels import cuda_ops
    from host_client.cuda_device import device_pointer

    rng = np.random.default_rng(nbytes)
    cases = [*CASES, (S.LANDED, 5, False, 0)]
    sizes = [nbytes] * len(CASES) + [2 * nbytes]
    blobs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    states = np.zeros(len(cases), abi.SLOT_STATE_DTYPE)
    for i, ((state, generation, _, _), blob) in enumerate(zip(cases, blobs, strict=True)):
        states[i] = (state_word(generation, state), 0, terms_sum(blob))
    for (_, _, corrupt, _), blob in zip(cases, blobs, strict=True):
        if corrupt:
            blob[blob.size // 3] ^= 0x01
    twin_states = states.copy()
    want = reference.verify_landed_batch(  # a timeout a sanitizer's slowness cannot reach
        twin_states, [(i, 5, blob) for i, blob in enumerate(blobs)], timeout_s=1.0)
    assert want == [outcome for *_, outcome in cases]
    checks = np.zeros(len(cases), abi.CHECK_DTYPE)
    rt = cp.cuda.runtime
    rt.hostRegister(states.ctypes.data, states.nbytes, 0x1 | 0x2)
    rt.hostRegister(checks.ctypes.data, checks.nbytes, 0x1 | 0x2)
    try:
        on_gpu = [cp.asarray(b) for b in blobs]
        entries = device_pointer(states.ctypes.data)
        checks["entry"] = [entries + i * abi.SLOT_STATE_DTYPE.itemsize for i in range(len(cases))]
        checks["generation"] = 5
        checks["data"] = [int(b.data.ptr) for b in on_gpu]
        checks["n16"] = [b.size // 16 for b in on_gpu]
        results = cp.full(len(cases), 0xFFFFFFFF, cp.uint32)
        scratch = cp.zeros(4 * len(cases), cp.uint32)
        stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()  # the fills above ran on the null stream, which a
        # non-blocking stream does not wait for (a sanitizer's slowness once showed it)
        cuda_ops.verify_landed_batch(device_pointer(checks.ctypes.data), len(cases),
                                     int(checks["n16"].max()), 1.0, results, scratch, stream)
        stream.synchronize()
        assert results.get().tolist() == want
        assert states.tobytes() == twin_states.tobytes()
        assert not scratch.get().any(), "the scratch words are left zero for the next batch"
    finally:
        rt.hostUnregister(checks.ctypes.data)
        rt.hostUnregister(states.ctypes.data)


def test_twin_publishes_nothing_when_the_slot_moved_on_while_summed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent gives an unheld LANDED slot to another delivery while its check sums the
    bytes: the check must not write the old generation's verdict over the new FILLING word."""
    blob = np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8)
    states = _states(5, S.LANDED, terms_sum(blob))
    evicted = state_word(6, S.FILLING)

    def sum_while_evicted(data: np.ndarray) -> int:
        states["word"][3] = evicted  # the agent's _claim, between the check's poll and verdict
        return terms_sum(data)

    monkeypatch.setattr(reference, "terms_sum", sum_while_evicted)
    assert reference.verify_landed(states, 3, 5, blob, timeout_s=0.01) == 2
    assert int(states["word"][3]) == evicted and states["status"][3] == 0


@pytest.mark.gpu
def test_cuda_verdict_is_not_published_over_a_moved_word() -> None:
    """``dpu_verify_landed`` launched as if its wait had seen LANDED (result word 4) while the
    word already reads the next generation's FILLING: outcome 2, the word and status kept."""
    import cupy as cp

    from gpu_kernels import launch
    from host_client.cuda_device import device_pointer

    blob = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    blob[5] ^= 1  # a mismatch would also write the status: nothing may be written at all
    states = _states(6, S.FILLING, terms_sum(blob) ^ 1)
    before = states.copy()
    cp.cuda.runtime.hostRegister(states.ctypes.data, states.nbytes, 0x1 | 0x2)
    try:
        result = cp.full(1, 4, cp.uint32)
        scratch = cp.zeros(2, cp.uint32)
        on_gpu = cp.asarray(blob)
        entry = device_pointer(states.ctypes.data) + 3 * abi.SLOT_STATE_DTYPE.itemsize
        launch.kernel("ready", "dpu_verify_landed")(
            (64,), (256,), (np.uint64(entry), np.uint64(5), on_gpu, np.uint64(blob.size // 16),
                            np.uint32(abi.Status.CHECKSUM_MISMATCH), result, scratch))
        cp.cuda.runtime.deviceSynchronize()
        assert int(result.get()[0]) == 2
        assert states.tobytes() == before.tobytes()
        assert not scratch.get().any()
    finally:
        cp.cuda.runtime.hostUnregister(states.ctypes.data)
