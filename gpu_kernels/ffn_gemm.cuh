// The expert FFN as two tiled matrix products, for the resident receiver (serve.cu) on messages
// of SERVE_GEMM_ROWS rows or more. Twin: reference.swiglu_bf16 (same formula; summation order
// differs, so results agree to float32 rounding before the final bf16 rounding).
#ifndef DPU_FFN_GEMM_CUH
#define DPU_FFN_GEMM_CUH
#include "ffn.cuh"

// Messages of SERVE_GEMM_ROWS rows or more (prefill-sized) on the row-major layout: the FFN as
// two tiled matrix products instead of row tiles of FFN_MAX_ROWS (each of which read every
// weight again: 4 MiB took ~5 ms more than cuBLAS on the H200). A block computes 64 x 64
// output tiles, staging 16 k at a time in shared memory; each of its 256 threads keeps a
// 4 x 4 block of sums (of gate and up together in the first product).
#define SERVE_GEMM_ROWS 64
#define GT 64
#define GK 16

__device__ __forceinline__ float gemm_load(const unsigned short* a, size_t i) {
    return __uint_as_float((unsigned)a[i] << 16);
}
__device__ __forceinline__ float gemm_load(const float* a, size_t i) { return a[i]; }

// acc[i][j] = sum_k A[r0 + 4 ty + i, k] * B[n0 + 4 tx + j, k] (and acc2 with B2 when TWO), for
// A [rows, K] row-major (bf16 bits or float) and B, B2 bf16 [N, K] row-major; zero outside.
template <typename TA, bool TWO>
__device__ void serve_gemm_tile(const TA* __restrict__ A, const unsigned short* __restrict__ B,
                                const unsigned short* __restrict__ B2, int rows, int N, int K,
                                int r0, int n0, float (&acc)[4][4], float (&acc2)[4][4]) {
    __shared__ float As[GK][GT + 4], Bs[GK][GT + 4], B2s[TWO ? GK : 1][GT + 4];
    const int t = threadIdx.x, ty = t / 16, tx = t % 16;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = acc2[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += GK) {
        for (int e = t; e < GT * GK; e += blockDim.x) {
            const int rr = e / GK, kk = e % GK, k = k0 + kk;
            const int r = r0 + rr, n = n0 + rr;
            As[kk][rr] = r < rows && k < K ? gemm_load(A, (size_t)r * K + k) : 0.0f;
            Bs[kk][rr] = n < N && k < K ? gemm_load(B, (size_t)n * K + k) : 0.0f;
            if (TWO) B2s[kk][rr] = n < N && k < K ? gemm_load(B2, (size_t)n * K + k) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GK; ++kk) {
            float a[4], b[4], b2[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[i] = As[kk][4 * ty + i];
                b[i] = Bs[kk][4 * tx + i];
                if (TWO) b2[i] = B2s[kk][4 * tx + i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[i][j] += a[i] * b[j];
                    if (TWO) acc2[i][j] += a[i] * b2[j];
                }
        }
        __syncthreads();
    }
}

// Every block: h = silu(x @ gate^T) * (x @ up^T), then (after the caller's barrier) out =
// bf16(h @ down^T); x bf16 [rows, hidden], gate and up [inter, hidden], down [hidden, inter].
__device__ void serve_gate_up_gemm(const unsigned short* x, const unsigned short* gate,
                                   const unsigned short* up, float* h, int rows, int hidden,
                                   int inter) {
    const int tiles_n = (inter + GT - 1) / GT, tiles = (rows + GT - 1) / GT * tiles_n;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int r0 = tile / tiles_n * GT, n0 = tile % tiles_n * GT;
        float g[4][4], u[4][4];
        serve_gemm_tile<unsigned short, true>(x, gate, up, rows, inter, hidden, r0, n0, g, u);
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) {
                const int r = r0 + 4 * ty + i, n = n0 + 4 * tx + j;
                if (r < rows && n < inter)
                    h[(size_t)r * inter + n] = g[i][j] / (1.0f + expf(-g[i][j])) * u[i][j];
            }
    }
}

__device__ void serve_down_gemm(const float* h, const unsigned short* down, unsigned short* out,
                                int rows, int hidden, int inter) {
    const int tiles_n = (hidden + GT - 1) / GT, tiles = (rows + GT - 1) / GT * tiles_n;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int r0 = tile / tiles_n * GT, n0 = tile % tiles_n * GT;
        float acc[4][4], unused[4][4];
        serve_gemm_tile<float, false>(h, down, nullptr, rows, hidden, inter, r0, n0, acc, unused);
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) {
                const int r = r0 + 4 * ty + i, n = n0 + 4 * tx + j;
                if (r < rows && n < hidden) out[(size_t)r * hidden + n] = to_bf16(acc[i][j]);
            }
    }
}

#endif  // DPU_FFN_GEMM_CUH
