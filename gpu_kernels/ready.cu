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

// The grid's share of a slot's checksum terms: its n16 16-byte vectors (blob at offset 0),
// this thread starting at vector `first`, `stride` apart.
// Four loads in flight per thread: a few blocks then sum a slot at a useful fraction of the
// memory bandwidth.
__device__ uint32_t dpu_blob_terms(const uint4* __restrict__ data, unsigned long long n16,
                                   unsigned long long first, unsigned long long stride) {
    uint32_t sum = 0;
    unsigned long long i = first;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = data[i], b = data[i + stride], c = data[i + 2 * stride],
                    d = data[i + 3 * stride];
        sum += dpu_vec_terms(a, 4 * i) + dpu_vec_terms(b, 4 * (i + stride)) +
               dpu_vec_terms(c, 4 * (i + 2 * stride)) + dpu_vec_terms(d, 4 * (i + 3 * stride));
    }
    for (; i < n16; i += stride) sum += dpu_vec_terms(data[i], 4 * i);
    return sum;
}

// By the last block of a slot's check, its whole sum `got` in hand: compare it with the entry's
// `expected` and publish the verdict for `generation` (status CHECKSUM_MISMATCH, then word
// FAILED; or word READY) unless the word no longer reads LANDED for `generation` (the agent gave
// the slot to another delivery while it was summed: nothing is written). Returns the outcome:
// 0 READY, 1 FAILED, 2 moved on.
__device__ uint32_t dpu_publish_verdict(dpu_slot_state* entry, uint64_t generation, uint32_t got,
                                        uint32_t status_mismatch) {
    const uint64_t landed = (generation << DPU_SLOT_STATE_BITS) | DPU_SLOT_LANDED;
    if (dpu_load_volatile_u64(&entry->word) != landed) return 2u;  // evicted while summed
    const bool ok = got == dpu_load_volatile_u32(&entry->expected);
    if (!ok) *(volatile uint32_t*)&entry->status = status_mismatch;
    __threadfence_system();
    *(volatile uint64_t*)&entry->word =
        (generation << DPU_SLOT_STATE_BITS) | (ok ? DPU_SLOT_READY : DPU_SLOT_FAILED);
    __threadfence_system();
    return ok ? 0u : 1u;
}

// When *result is 4 (LANDED): the grid sums the slot's blob into scratch[0]; the last block to
// finish publishes the verdict (dpu_publish_verdict) and sets *result to its outcome (a store
// between the verdict's re-read of the word and its own can still be overwritten:
// docs/ABI.md). scratch (uint32[2]: sum, blocks finished) is zero on entry and left zero.
// Otherwise nothing is done.
extern "C" __global__ void dpu_verify_landed(dpu_slot_state* entry, uint64_t generation,
                                             const uint4* __restrict__ data,
                                             unsigned long long n16, uint32_t status_mismatch,
                                             uint32_t* result, uint32_t* scratch) {
    __shared__ uint32_t partial[32];
    __shared__ bool last;
    if (*(volatile uint32_t*)result != DPU_WAIT_CHECK) return;
    const uint32_t total = dpu_block_sum(
        dpu_blob_terms(data, n16, blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x,
                       (unsigned long long)gridDim.x * blockDim.x), partial);
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
    *result = dpu_publish_verdict(entry, generation, got, status_mismatch);
}

// Words per slot of a batch check's scratch: 0 sum, 1 blocks that summed, 2 blocks done,
// 3 handed outcome + 1, 4-9 the handed grant (state entry, generation, blob: three u64).
#define DPU_CHECK_SCRATCH 10u
#define DPU_GRANT_PENDING 0xFFFFFFFFu
#define DPU_GRANT_REFUSED 5u  // the agent answered the ACQUIRE with an error: nothing to check
#define DPU_GRANT_BAD 6u      // the reply names no slot of this device that holds the blob

// The slot a batch check's reply grants, once the agent answered: DPU_GRANT_PENDING until the
// reply entry reads `c.seq`; then 0 with the slot's state entry, generation and blob, or
// DPU_GRANT_REFUSED, or DPU_GRANT_BAD (region unregistered or too small, state index out of
// the table), or 2 when the entry was reused while it was read (another request's reply).
__device__ uint32_t dpu_resolve_grant(const dpu_slot_check& c, const dpu_region* regions,
                                      dpu_slot_state** entry, uint64_t* generation,
                                      const uint4** data) {
    const dpu_reply* reply = (const dpu_reply*)c.reply;
    if (dpu_load_volatile_u64(&reply->seq) != c.seq) return DPU_GRANT_PENDING;
    __threadfence_system();  // the body was stored before seq: read it after
    const uint32_t status = dpu_load_volatile_u32(&reply->status);
    const uint32_t region = dpu_load_volatile_u32(&reply->region_id);
    const uint32_t index = dpu_load_volatile_u32(&reply->state_index);
    const uint64_t gen = dpu_load_volatile_u64(&reply->generation);
    const uint64_t offset = dpu_load_volatile_u64(&reply->slot_offset);
    __threadfence_system();
    if (dpu_load_volatile_u64(&reply->seq) != c.seq) return 2u;
    if (status != 0) return DPU_GRANT_REFUSED;
    if (region >= DPU_MAX_REGIONS || index >= DPU_MAX_CHANNEL_SLOTS) return DPU_GRANT_BAD;
    const uint64_t size = regions[region].size, bytes = c.n16 * 16;
    if (size == 0 || offset > size || bytes > size - offset) return DPU_GRANT_BAD;
    *entry = (dpu_slot_state*)c.states + index;
    *generation = gen;
    *data = (const uint4*)(regions[region].base + offset);
    return 0u;
}

// The checks of a batch of ACQUIREs, started when they were posted: grid (G, n), blocks (x, y)
// check request y of `checks`. Block (0, y) polls the request's reply and then the granted
// slot's word (host memory) and hands the outcome, with the grant it resolved, to its G - 1
// siblings through scratch words 3-9 (device memory, so one poller per slot crosses PCIe: a
// reply resolved by every block of a large grid costs ~0.7 us of fenced PCIe reads per block,
// serialized, ~180 us for 36 blocks on an H100); a sibling also reads
// the reply and the word itself when it starts and at every 16th look after, ~30 us apart, so
// it never depends on the poller being resident. Only when all G blocks summed the bytes does
// the last to finish publish a verdict (dpu_publish_verdict). results[y]: 0 READY, 1 FAILED,
// 2 moved on, 3 timed out, 5 refused, 6 bad grant. regions: the device's region table (device
// memory). scratch: uint32[DPU_CHECK_SCRATCH * n], zero on entry, left zero by a summing launch.
// Two ways to launch it (cuda_ops.verify_granted_batch):
// - wait_only = 0 alone: the G blocks of each slot sit resident until it lands, and each slot is
//   verified as soon as its own bytes land;
// - wait_only = 1 with grid (1, n), then wait_only = 0 on the same stream: the first launch's
//   n pollers wait (one small block per slot) and leave each outcome in scratch word 3; the
//   second, once every slot of the batch ended, takes the handed outcomes and sums with as many
//   blocks as the GPU holds. No block idles resident beside other kernels while the bytes move.
//   Launched so per request (n = 1, `checks`, `results` and `scratch` offset to it), in order,
//   each slot is summed by the GPU as soon as it lands.
extern "C" __global__ void dpu_verify_granted_batch(const dpu_slot_check* checks,
                                                    const dpu_region* regions,
                                                    uint64_t timeout_ns, uint32_t status_mismatch,
                                                    uint32_t* results, uint32_t* scratch,
                                                    uint32_t wait_only) {
    __shared__ uint32_t partial[32];
    __shared__ uint32_t outcome;
    __shared__ bool last;
    __shared__ dpu_slot_state* entry;
    __shared__ uint64_t generation;
    __shared__ const uint4* data;
    const dpu_slot_check c = checks[blockIdx.y];
    uint32_t* s = scratch + DPU_CHECK_SCRATCH * blockIdx.y;
    if (threadIdx.x == 0) {
        uint64_t start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        uint32_t grant = DPU_GRANT_PENDING;
        unsigned int backoff = 64;
        // After a wait-only launch, block 0 too takes the outcome handed in scratch word 3.
        if (blockIdx.x == 0 && (wait_only || dpu_load_volatile_u32(s + 3) == 0u)) {
            for (;;) {
                grant = dpu_resolve_grant(c, regions, &entry, &generation, &data);
                if (grant != DPU_GRANT_PENDING) break;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (now - start > timeout_ns) { grant = 3u; break; }
                __nanosleep(backoff);
                if (backoff < 2048) backoff <<= 1;
            }
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            outcome = grant != 0u ? grant
                : dpu_poll_word(&entry->word, generation,
                                timeout_ns > now - start ? timeout_ns - (now - start) : 0, true);
            if (grant == 0u) {
                volatile uint64_t* grant_words = (volatile uint64_t*)(s + 4);
                grant_words[0] = (uint64_t)entry;
                grant_words[1] = generation;
                grant_words[2] = (uint64_t)data;
            }
            __threadfence();
            *(volatile uint32_t*)(s + 3) = outcome + 1;
        } else {
            for (unsigned int i = 1;; ++i) {
                const uint32_t handed = dpu_load_volatile_u32(s + 3);
                if (handed) {
                    outcome = handed - 1;
                    if (outcome == DPU_WAIT_CHECK) {
                        const volatile uint64_t* grant_words = (const volatile uint64_t*)(s + 4);
                        entry = (dpu_slot_state*)grant_words[0];
                        generation = grant_words[1];
                        data = (const uint4*)grant_words[2];
                    }
                    break;
                }
                if ((i & 15u) == 1) {
                    if (grant == DPU_GRANT_PENDING)
                        grant = dpu_resolve_grant(c, regions, &entry, &generation, &data);
                    if (grant == 0u &&
                        dpu_load_volatile_u64(&entry->word) ==
                            ((generation << DPU_SLOT_STATE_BITS) | DPU_SLOT_LANDED)) {
                        outcome = DPU_WAIT_CHECK;
                        break;
                    }
                }
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (now - start > timeout_ns) { outcome = 3u; break; }
                __nanosleep(backoff);
                if (backoff < 2048) backoff <<= 1;
            }
        }
    }
    __syncthreads();
    if (wait_only) return;
    const bool landed = outcome == DPU_WAIT_CHECK;
    const uint32_t total = dpu_block_sum(
        landed ? dpu_blob_terms(data, c.n16,
                                blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x,
                                (unsigned long long)gridDim.x * blockDim.x)
               : 0u, partial);
    if (threadIdx.x == 0) {
        if (landed) {
            atomicAdd(s, total);
            atomicAdd(s + 1, 1u);
        }
        __threadfence();
        last = atomicAdd(s + 2, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    const uint32_t got = atomicAdd(s, 0u);
    const uint32_t summed = atomicAdd(s + 1, 0u);
    for (uint32_t w = 0; w < DPU_CHECK_SCRATCH; ++w) s[w] = 0;
    if (summed != gridDim.x) {  // some block saw no landing: no verdict from this check
        results[blockIdx.y] = landed ? 3u : outcome;
        return;
    }
    results[blockIdx.y] = dpu_publish_verdict(entry, generation, got, status_mismatch);
}
