// Readiness of a slot, on the stream of the process that computes with it.
//
// A DMA-engine device's deliveries end LANDED: the engine copied every chunk (a DMA engine
// cannot check bytes) and the agent wrote LANDED with the blob's expected sum. The inference
// process checks the slot with dpu_wait_landed + dpu_verify_landed on a stream of its own
// context (the GPUNetIO pattern: the DPU writes data and a status word, a kernel of the GPU's
// owner checks and completes), so no other context takes the GPU's time slices for it, and
// kernels enqueued behind them on the same stream read verified bytes. A waiter that did not
// launch the check waits for its verdict with dpu_wait_ready.
//
// Outcomes (WAIT_OUTCOMES in cuda_ops.py): 0 READY, 1 FAILED, 2 the slot moved to a later
// generation, 3 timed out, 4 LANDED (dpu_wait_landed only: the bytes wait for their check).
#include "ring.cuh"

#define DPU_WAIT_CHECK 4u

// One thread: poll the word (host memory the device registered, mapped) for `generation`.
__device__ uint32_t dpu_poll_word(const uint64_t* word, uint64_t generation,
                                  uint64_t timeout_ns, bool stop_at_landed) {
    uint64_t start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    unsigned int backoff = 64;
    for (;;) {
        const uint64_t w = dpu_load_volatile_u64(word);
        const uint64_t gen = w >> DPU_SLOT_STATE_BITS;
        const uint32_t state = (uint32_t)(w & ((1u << DPU_SLOT_STATE_BITS) - 1));
        if (gen == generation && state == DPU_SLOT_READY) return 0;
        if (gen == generation && state == DPU_SLOT_FAILED) return 1;
        if (gen == generation && state == DPU_SLOT_LANDED && stop_at_landed) return DPU_WAIT_CHECK;
        if (gen > generation) return 2;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) return 3;
        __nanosleep(backoff);
        if (backoff < 2048) backoff <<= 1;
    }
}

// Wait until the slot reads READY or FAILED for `generation` (or moved on, or timed out).
extern "C" __global__ void dpu_wait_ready(const uint64_t* word, uint64_t generation,
                                          uint64_t timeout_ns, uint32_t* result) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    *result = dpu_poll_word(word, generation, timeout_ns, false);
    __threadfence();
}

// Wait until the slot's bytes landed (outcome 4) or its delivery ended otherwise.
extern "C" __global__ void dpu_wait_landed(const uint64_t* word, uint64_t generation,
                                           uint64_t timeout_ns, uint32_t* result) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    *result = dpu_poll_word(word, generation, timeout_ns, true);
    __threadfence();
}

// When *result is 4 (LANDED): the grid sums the terms of the slot's n16 16-byte vectors (its
// blob placed at offset 0) into scratch[0]; the last block to finish compares the sum with the
// entry's `expected` and publishes the verdict for `generation`: status CHECKSUM_MISMATCH
// (status_mismatch) then word FAILED, or word READY; *result becomes 0 or 1 (2, publishing
// nothing, when the word no longer reads LANDED for `generation`: the agent gave the slot to
// another delivery while it was summed; a store between this re-read and the verdict's can
// still be overwritten: docs/ABI.md). scratch
// (uint32[2]: sum, blocks finished) is zero on entry and left zero. Otherwise nothing is done.
extern "C" __global__ void dpu_verify_landed(dpu_slot_state* entry, uint64_t generation,
                                             const uint4* __restrict__ data,
                                             unsigned long long n16, uint32_t status_mismatch,
                                             uint32_t* result, uint32_t* scratch) {
    __shared__ uint32_t partial[32];
    __shared__ bool last;
    if (*(volatile uint32_t*)result != DPU_WAIT_CHECK) return;
    uint32_t sum = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n16; i += (unsigned long long)gridDim.x * blockDim.x)
        sum += dpu_vec_terms(data[i], 4 * i);
    const uint32_t total = dpu_block_sum(sum, partial);
    if (threadIdx.x == 0) {
        atomicAdd(scratch, total);
        __threadfence();
        last = atomicAdd(scratch + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    const uint32_t got = atomicAdd(scratch, 0u);
    scratch[0] = 0;
    scratch[1] = 0;
    const uint64_t landed = (generation << DPU_SLOT_STATE_BITS) | DPU_SLOT_LANDED;
    if (dpu_load_volatile_u64(&entry->word) != landed) {  // evicted while summed: not ours
        *result = 2u;
        return;
    }
    const bool ok = got == dpu_load_volatile_u32(&entry->expected);
    if (!ok) *(volatile uint32_t*)&entry->status = status_mismatch;
    __threadfence_system();
    *(volatile uint64_t*)&entry->word =
        (generation << DPU_SLOT_STATE_BITS) | (ok ? DPU_SLOT_READY : DPU_SLOT_FAILED);
    __threadfence_system();
    *result = ok ? 0u : 1u;
}
