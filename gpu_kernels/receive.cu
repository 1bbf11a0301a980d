// Persistent receive kernel: the GPUNetIO-shaped consumer of the agent's work ring.
//
// Every block claims the next ring position from a device counter, waits for that entry's seq
// word (store-only publication, see docs/ABI.md), copies the descriptor into shared memory,
// releases the ring entry in claim order, bounds-checks it against the region table, moves the
// bytes with 16-byte loads spread over the block, reduces the chunk checksum, and publishes a
// completion entry. It returns when the work ring's exit flag is set (by the host, or by an
// EXIT descriptor).
#include "ring.cuh"

// Device-memory bookkeeping shared by the blocks of one launch (zeroed before launch).
struct dpu_receive_state {
    unsigned long long work_claim;        // next work position a block will take
    unsigned long long work_released;     // work positions released to the producer
    unsigned long long completion_claim;  // next completion position
    unsigned long long descriptors_done;  // for diagnostics
};

__device__ __forceinline__ bool dpu_exit_requested(const dpu_ring_header* h) {
    return dpu_load_volatile_u32(&h->exit_flag) != 0;
}

__device__ unsigned int dpu_check(const dpu_descriptor& d, const dpu_region* regions) {
    const unsigned int op = d.opcode;
    if (op == DPU_OP_NOP || op == DPU_OP_FENCE || op == DPU_OP_EXIT) return DPU_STATUS_OK;
    if (op != DPU_OP_COPY) return DPU_STATUS_BAD_OPCODE;
    if (d.src_region >= DPU_MAX_REGIONS || d.dst_region >= DPU_MAX_REGIONS)
        return DPU_STATUS_BAD_REGION;
    const dpu_region s = regions[d.src_region];
    const dpu_region t = regions[d.dst_region];
    if (s.size == 0 || t.size == 0 || !(s.flags & DPU_REGION_READABLE) ||
        !(t.flags & DPU_REGION_WRITABLE))
        return DPU_STATUS_BAD_REGION;
    if ((d.length | d.src_offset | d.dst_offset | d.position) % DPU_COPY_ALIGN_BYTES)
        return DPU_STATUS_BAD_ALIGNMENT;
    // Written so that no addition can wrap.
    if (d.src_offset > s.size || d.length > s.size - d.src_offset) return DPU_STATUS_OUT_OF_BOUNDS;
    if (d.dst_offset > t.size || d.length > t.size - d.dst_offset) return DPU_STATUS_OUT_OF_BOUNDS;
    return DPU_STATUS_OK;
}

// Copies n16 16-byte vectors and returns this thread's share of the checksum sum.
__device__ __forceinline__ uint32_t dpu_copy_block(const uint4* __restrict__ src,
                                                   uint4* __restrict__ dst, uint64_t n16,
                                                   uint64_t first_word, bool verify) {
    uint32_t sum = 0;
    const uint64_t stride = blockDim.x;
    uint64_t i = threadIdx.x;
    // Four independent 16-byte loads in flight per thread hide PCIe latency on host sources.
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v0 = src[i], v1 = src[i + stride], v2 = src[i + 2 * stride], v3 = src[i + 3 * stride];
        dst[i] = v0;
        dst[i + stride] = v1;
        dst[i + 2 * stride] = v2;
        dst[i + 3 * stride] = v3;
        if (verify) {
            sum += dpu_vec_terms(v0, first_word + 4 * i);
            sum += dpu_vec_terms(v1, first_word + 4 * (i + stride));
            sum += dpu_vec_terms(v2, first_word + 4 * (i + 2 * stride));
            sum += dpu_vec_terms(v3, first_word + 4 * (i + 3 * stride));
        }
    }
    for (; i < n16; i += stride) {
        uint4 v = src[i];
        dst[i] = v;
        if (verify) sum += dpu_vec_terms(v, first_word + 4 * i);
    }
    return sum;
}

extern "C" __global__ void dpu_receive(dpu_ring_header* work_hdr, dpu_descriptor* work,
                                       dpu_ring_header* comp_hdr, dpu_completion* comp,
                                       const dpu_region* regions, dpu_receive_state* state) {
    __shared__ dpu_descriptor d;
    __shared__ unsigned int stop;
    __shared__ unsigned int status;
    __shared__ uint32_t scratch[32];
    const uint64_t wmask = work_hdr->capacity - 1;
    const uint64_t cmask = comp_hdr->capacity - 1;
    const uint64_t ccap = comp_hdr->capacity;

    if (threadIdx.x == 0 && blockIdx.x == 0) {
        if (work_hdr->magic != DPU_RING_MAGIC || work_hdr->version != DPU_ABI_VERSION ||
            work_hdr->kind != DPU_RING_WORK || comp_hdr->magic != DPU_RING_MAGIC ||
            comp_hdr->version != DPU_ABI_VERSION || comp_hdr->kind != DPU_RING_COMPLETION) {
            work_hdr->fault = DPU_STATUS_BAD_RING;
            __threadfence_system();
            work_hdr->exit_flag = 1;
        }
    }

    for (;;) {
        if (threadIdx.x == 0) {
            stop = 0;
            const uint64_t pos = atomicAdd(&state->work_claim, 1ull);
            const dpu_descriptor* e = &work[pos & wmask];
            unsigned int backoff = 32;
            while (dpu_load_volatile_u64(&e->seq) != pos + 1) {
                if (dpu_exit_requested(work_hdr)) { stop = 1; break; }
                __nanosleep(backoff);
                if (backoff < 1024) backoff <<= 1;
            }
            if (!stop) {
                __threadfence_system();
                const volatile uint64_t* s = (const volatile uint64_t*)e;
                uint64_t* t = (uint64_t*)&d;
#pragma unroll
                for (int k = 0; k < 8; ++k) t[k] = s[k];
                // Release ring entries in claim order so the producer's free count is exact.
                while (dpu_load_volatile_u64((const uint64_t*)&state->work_released) != pos) {
                    if (dpu_exit_requested(work_hdr)) { stop = 1; break; }
                }
                if (!stop) {
                    *(volatile uint64_t*)&work_hdr->consumer = pos + 1;
                    *(volatile unsigned long long*)&state->work_released = pos + 1;
                    __threadfence_system();
                    status = dpu_check(d, regions);
                }
            }
        }
        __syncthreads();
        if (stop) return;

        uint64_t nbytes = 0;
        if (status == DPU_STATUS_OK && d.opcode == DPU_OP_COPY) {
            const bool verify = (d.flags & DPU_DESC_VERIFY) != 0;
            const uint4* src = (const uint4*)(regions[d.src_region].base + d.src_offset);
            uint4* dst = (uint4*)(regions[d.dst_region].base + d.dst_offset);
            const uint32_t part = dpu_copy_block(src, dst, d.length / 16, d.position / 4, verify);
            const uint32_t total = dpu_block_sum(part, scratch);
            nbytes = d.length;
            if (threadIdx.x == 0 && verify &&
                dpu_checksum_finish(total, d.length) != d.checksum)
                status = DPU_STATUS_CHECKSUM_MISMATCH;
            // Make the slot bytes visible device- and system-wide before the completion.
            __threadfence_system();
        }
        __syncthreads();

        if (threadIdx.x == 0) {
            const uint64_t cpos = atomicAdd(&state->completion_claim, 1ull);
            while (cpos - dpu_load_volatile_u64(&comp_hdr->consumer) >= ccap) {
                if (dpu_exit_requested(work_hdr)) break;
                __nanosleep(256);
            }
            volatile dpu_completion* c = &comp[cpos & cmask];
            c->transfer_id = d.transfer_id;
            c->chunk_index = d.chunk_index;
            c->status = status;
            c->nbytes = nbytes;
            // An EXIT raises the flag before its completion is visible, so whoever sees the
            // completion also sees the flag.
            if (d.opcode == DPU_OP_EXIT && status == DPU_STATUS_OK)
                *(volatile uint32_t*)&work_hdr->exit_flag = 1;
            __threadfence_system();
            c->seq = cpos + 1;
            atomicAdd(&state->descriptors_done, 1ull);
        }
        __syncthreads();
    }
}
