// Stream wait on a slot's readiness: one thread polls the slot-state word (host memory the
// device registered, mapped) until it reads READY or FAILED for the expected generation, a
// later generation, or the time runs out. Kernels enqueued behind it on the same stream run
// after it returns, so expert compute can be queued before the expert has landed.
// result: 0 READY, 1 FAILED, 2 the slot moved to a later generation, 3 timed out.
#include "ring.cuh"

extern "C" __global__ void dpu_wait_ready(const uint64_t* word, uint64_t generation,
                                          uint64_t timeout_ns, uint32_t* result) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    uint64_t start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    unsigned int backoff = 64;
    for (;;) {
        const uint64_t w = dpu_load_volatile_u64(word);
        const uint64_t gen = w >> DPU_SLOT_STATE_BITS;
        const uint32_t state = (uint32_t)(w & ((1u << DPU_SLOT_STATE_BITS) - 1));
        if (gen == generation && state == DPU_SLOT_READY) { *result = 0; break; }
        if (gen == generation && state == DPU_SLOT_FAILED) { *result = 1; break; }
        if (gen > generation) { *result = 2; break; }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) { *result = 3; break; }
        __nanosleep(backoff);
        if (backoff < 2048) backoff <<= 1;
    }
    __threadfence();
}
