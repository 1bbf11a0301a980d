// MoE helpers and the standalone checksum. Twins: gpu_kernels/reference.py.
#include "ring.cuh"

// Dispatch: packed[r, :] = hidden[order[r] / top_k, :] for r < rows; rows are row_bytes long
// (a multiple of 16). One block per packed row, 16-byte vectors.
extern "C" __global__ void dpu_dispatch_rows(const uint4* __restrict__ hidden,
                                             const long long* __restrict__ order, int top_k,
                                             long long rows, long long row_vecs,
                                             uint4* __restrict__ packed) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const uint4* src = hidden + (order[r] / top_k) * row_vecs;
        uint4* dst = packed + r * row_vecs;
        for (long long i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[i] = src[i];
    }
}

__device__ __forceinline__ float dpu_bf16_to_f32(unsigned int bits) {
    return __uint_as_float(bits << 16);
}

__device__ __forceinline__ unsigned int dpu_f32_to_bf16(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // round to nearest even (finite inputs)
}

// Combine: out[t, :] = sum_k weights[t, k] * expert_out[inv[t * top_k + k], :], bf16 in and
// out, fp32 accumulation in k order with no fused multiply-add, so the NumPy twin matches
// bit for bit. One block per token, each thread 8 columns (one 16-byte vector) at a time.
extern "C" __global__ void dpu_combine_bf16(const uint4* __restrict__ expert_out,
                                            const long long* __restrict__ inv,
                                            const float* __restrict__ weights, int top_k,
                                            long long tokens, long long row_vecs,
                                            uint4* __restrict__ out) {
    for (long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        for (long long i = threadIdx.x; i < row_vecs; i += blockDim.x) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int k = 0; k < top_k; ++k) {
                const float w = weights[t * top_k + k];
                const uint4 v = expert_out[inv[t * top_k + k] * row_vecs + i];
                const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, dpu_bf16_to_f32(words[j] & 0xFFFFu)));
                    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, dpu_bf16_to_f32(words[j] >> 16)));
                }
            }
            uint4 o;
            o.x = dpu_f32_to_bf16(acc[0]) | (dpu_f32_to_bf16(acc[1]) << 16);
            o.y = dpu_f32_to_bf16(acc[2]) | (dpu_f32_to_bf16(acc[3]) << 16);
            o.z = dpu_f32_to_bf16(acc[4]) | (dpu_f32_to_bf16(acc[5]) << 16);
            o.w = dpu_f32_to_bf16(acc[6]) | (dpu_f32_to_bf16(acc[7]) << 16);
            out[t * row_vecs + i] = o;
        }
    }
}

// Checksums of a run of consecutive chunks: n16 16-byte vectors at data, placed `position`
// bytes into their object, cut into chunks of chunk_n16 vectors (the last may be shorter).
// Block row blockIdx.y sums chunk blockIdx.y into out[blockIdx.y], which must be zero on entry
// (the host xors each chunk's word count). One chunk: chunk_n16 = n16, gridDim.y = 1.
extern "C" __global__ void dpu_checksum(const uint4* __restrict__ data, unsigned long long n16,
                                        unsigned long long chunk_n16,
                                        unsigned long long position, unsigned int* out) {
    __shared__ uint32_t scratch[32];
    uint32_t sum = 0;
    const unsigned long long first = position / 4;
    const unsigned long long begin = blockIdx.y * chunk_n16;
    const unsigned long long end = begin + chunk_n16 < n16 ? begin + chunk_n16 : n16;
    for (unsigned long long i = begin + blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < end; i += (unsigned long long)gridDim.x * blockDim.x)
        sum += dpu_vec_terms(data[i], first + 4 * i);
    const uint32_t total = dpu_block_sum(sum, scratch);
    if (threadIdx.x == 0) atomicAdd(out + blockIdx.y, total);
}
