"""The check of a slot the DMA engine filled (state LANDED): the blob's expected sum from its
chunk checksums, the NumPy twin that publishes READY or FAILED, and the CUDA kernels against
the twin (same outcomes, same slot-state bytes)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_offload import abi, futex
from dpu_offload.channel import Channel, split_word, state_word
from dpu_offload.checksum import blob_checksums, blob_sum, terms_sum
from gpu_kernels import reference

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


@pytest.mark.parametrize("corrupt", [False, True])
def test_twin_wakes_the_words_sleeper_with_its_verdict(corrupt: bool) -> None:
    """A thread asleep on the LANDED word (as a CPU device's waiter is) is woken by the
    verdict, long before its own timeout: it need not poll beside the check."""
    blob = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
    states = _states(5, S.LANDED, terms_sum(blob))
    if corrupt:
        blob[9] ^= 1
    address = states[3:4]["word"].ctypes.data
    landed = state_word(5, S.LANDED)
    woke: list[float] = []

    def sleeper() -> None:
        t0 = time.monotonic()
        futex.wait(address, landed, 30.0)
        woke.append(time.monotonic() - t0)

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.2)  # asleep in the futex by now
    assert reference.verify_landed(states, 3, 5, blob, timeout_s=1.0) == int(corrupt)
    thread.join(10.0)
    assert woke and woke[0] < 10.0, "the sleeper waited out its timeout"
    assert split_word(int(states["word"][3]))[1] == (S.FAILED if corrupt else S.READY)


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


GRANT_CASES = [  # requests whose reply grants no slot to check -> outcome
    ("refused", 5), ("unregistered region", 6), ("slot past its region", 6), ("no reply", 3)]


def _posted_batch(nbytes: int) -> tuple[Channel, np.ndarray, np.ndarray, list[tuple[int, int]],
                                        list[int]]:
    """A channel whose first requests are a batch of ACQUIREs answered as ``CASES`` (slot i of
    a pool in region 1, generation 5; one case twice the size) and ``GRANT_CASES`` say; returns
    (channel, region table, pool bytes, (position, blob bytes) per request, outcomes)."""
    rng = np.random.default_rng(nbytes)
    cases = [*CASES, (S.LANDED, 5, False, 0)]
    sizes = [nbytes] * len(CASES) + [2 * nbytes]
    pool = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    channel = Channel.format(np.zeros(abi.channel_layout(64).total, np.uint8), 64)
    regions = np.zeros(abi.MAX_REGIONS, abi.REGION_DTYPE)
    regions[1] = (0, pool.size, abi.RegionFlags.WRITABLE, 0)
    for i, ((state, generation, corrupt, _), at, n) in enumerate(
            zip(cases, offsets, sizes, strict=True)):
        blob = pool[at:at + n]
        channel.states[i] = (state_word(generation, state), 0, terms_sum(blob))
        if corrupt:
            blob[n // 3] ^= 0x01
        channel.reply(i, i + 1, abi.RequestStatus.OK, region_id=1, slot_index=i, state_index=i,
                      generation=5, slot_offset=at)
    first = len(cases)
    channel.reply(first, first + 1, abi.RequestStatus.NOT_FOUND, "no such expert")
    channel.reply(first + 1, first + 2, abi.RequestStatus.OK, region_id=2, state_index=9,
                  generation=5)
    channel.reply(first + 2, first + 3, abi.RequestStatus.OK, region_id=1, state_index=9,
                  generation=5, slot_offset=pool.size - nbytes + 16)
    checks = [*zip(range(len(cases)), sizes, strict=True),
              *((first + j, nbytes) for j in range(len(GRANT_CASES)))]
    return channel, regions, pool, checks, [o for *_, o in cases] + [o for _, o in GRANT_CASES]


def test_twin_takes_each_slot_of_a_posted_batch_from_its_reply() -> None:
    """A batch check started at posting: each request's slot comes from its reply (refused,
    unregistered or too-small grants checked for nothing), its verdict as a single check's."""
    channel, regions, pool, checks, want = _posted_batch(4096)
    before = channel.states.copy()
    got = reference.verify_granted_batch(channel, regions,
                                         lambda region, at, n: pool[at:at + n], checks, 0.05)
    assert got == want
    for i, (state, generation, corrupt, _) in enumerate([*CASES, (S.LANDED, 5, False, 0)]):
        if state == S.LANDED and generation == 5:
            assert split_word(int(channel.states["word"][i])) == (
                5, S.FAILED if corrupt else S.READY)
        else:
            assert channel.states[i].tobytes() == before[i].tobytes()
    assert channel.states[9].tobytes() == before[9].tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["resident", "batch", "slot"])
@pytest.mark.parametrize("nbytes", [16, 4096, 3 << 20])
def test_cuda_batch_check_matches_the_twin(nbytes: int, form: str) -> None:
    """The batch check, launched before the replies are read, in each of its forms (blocks
    resident per slot; a wait, then a sum with the GPU, for the batch or per slot), checks every
    request of ``_posted_batch``: each outcome and slot-state byte is the twin's; the scratch is
    left zero."""
    import cupy as cp

    from gpu_kernels import cuda_ops
    from host_client.cuda_device import device_pointer

    channel, regions, pool, checks, want = _posted_batch(nbytes)
    twin = Channel(channel.buffer.copy())
    assert reference.verify_granted_batch(  # a timeout a sanitizer's slowness cannot reach
        twin, regions, lambda region, at, n: pool[at:at + n], checks, 1.0) == want
    params = np.zeros(len(checks), abi.CHECK_DTYPE)
    rt = cp.cuda.runtime
    rt.hostRegister(channel.buffer.ctypes.data, channel.buffer.nbytes, 0x1 | 0x2)
    rt.hostRegister(params.ctypes.data, params.nbytes, 0x1 | 0x2)
    try:
        on_gpu = cp.asarray(pool)
        table = regions.copy()
        table[1]["base"] = int(on_gpu.data.ptr)
        table_on_gpu = cp.asarray(table.view(np.uint8))
        at = device_pointer(channel.buffer.ctypes.data)
        layout = abi.channel_layout(channel.capacity)
        params["reply"] = [at + layout.replies + p * abi.REPLY_DTYPE.itemsize for p, _ in checks]
        params["seq"] = [p + 1 for p, _ in checks]
        params["states"] = at + layout.states
        params["n16"] = [n // 16 for _, n in checks]
        results = cp.full(len(checks), 0xFFFFFFFF, cp.uint32)
        scratch = cp.zeros(cuda_ops.CHECK_SCRATCH_WORDS * len(checks), cp.uint32)
        stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()  # the fills above ran on the null stream, which a
        # non-blocking stream does not wait for (a sanitizer's slowness once showed it)
        cuda_ops.verify_granted_batch(device_pointer(params.ctypes.data), len(checks),
                                      int(params["n16"].max()), table_on_gpu, 1.0, results,
                                      scratch, stream, form=form)
        stream.synchronize()
        assert results.get().tolist() == want
        assert channel.states.tobytes() == twin.states.tobytes()
        assert not scratch.get().any(), "the scratch words are left zero for the next batch"
    finally:
        rt.hostUnregister(params.ctypes.data)
        rt.hostUnregister(channel.buffer.ctypes.data)


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
