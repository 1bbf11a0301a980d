// The resident receiver's expert layouts (dpu_serve_model, one per model, filled by
// host_client/serve_tables.py) and its FFN for the layouts that are not row-major: any element
// strides (Llama-4's [H, 2I] / [I, H]) and gpt-oss's clamped SwiGLU with biases. Used by
// serve.cu; the row-major layout's FFN is ffn.cuh's and ffn_gemm.cuh's.
#ifndef DPU_SERVE_FFN_CUH
#define DPU_SERVE_FFN_CUH
#include "ffn.cuh"

#define SERVE_CONTIGUOUS 1u  // gate [I, H], up [I, H], down [H, I], each row-major (16-byte loads)
#define SERVE_STRIDED 2u     // SwiGLU with the element strides below (Llama-4's [H, 2I], [I, H])
#define SERVE_CLAMPED 3u     // gpt-oss: strided, biases, min/clip at limit, sigmoid(alpha g)

typedef struct {
    unsigned long long gate, up, down;  // byte offsets in the expert's blob
    unsigned long long blob_bytes;
    unsigned long long gate_bias, up_bias, down_bias;  // byte offsets (SERVE_CLAMPED)
    unsigned int hidden, inter;         // values; both multiples of 8
    unsigned int kind;                  // SERVE_*; 0: not served here
    unsigned int g_sj, g_sk;            // gate / up element (j, k) at j * g_sj + k * g_sk
    unsigned int d_si, d_sj;            // down element (i, j) at i * d_si + j * d_sj
    unsigned int b_s;                   // gate / up bias element j at j * b_s
    float alpha, limit;
} dpu_serve_model;

__device__ __forceinline__ float bf16_at(const unsigned char* base, unsigned long long element) {
    return __uint_as_float((unsigned)((const unsigned short*)base)[element] << 16);
}

// h[r, j] for rows [0, rows) of x (bf16 [rows, hidden]) with any element strides: one warp per
// column j (first, first + stride, ...), the lanes over k.
__device__ void serve_gate_up_strided(const unsigned short* __restrict__ x,
                                      const unsigned char* blob, const dpu_serve_model m,
                                      float* __restrict__ h, int rows, int first, int stride) {
    const int lane = threadIdx.x & 31;
    for (int j = first; j < (int)m.inter; j += stride) {
        float g[FFN_MAX_ROWS], u[FFN_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) g[r] = u[r] = 0.0f;
        const unsigned long long row = (unsigned long long)j * m.g_sj;
        for (int k = lane; k < (int)m.hidden; k += 32) {
            const unsigned long long e = row + (unsigned long long)k * m.g_sk;
            const float gw = bf16_at(blob + m.gate, e), uw = bf16_at(blob + m.up, e);
#pragma unroll
            for (int r = 0; r < FFN_MAX_ROWS; ++r) {
                if (r < rows) {
                    const float xv = __uint_as_float((unsigned)x[(size_t)r * m.hidden + k] << 16);
                    g[r] += gw * xv;
                    u[r] += uw * xv;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) {
            if (r < rows) {
                float gs = warp_sum(g[r]), us = warp_sum(u[r]), hv;
                if (m.kind == SERVE_CLAMPED) {
                    gs = fminf(gs + bf16_at(blob + m.gate_bias, (unsigned long long)j * m.b_s),
                               m.limit);
                    us = fminf(fmaxf(us + bf16_at(blob + m.up_bias,
                                                  (unsigned long long)j * m.b_s), -m.limit),
                               m.limit);
                    hv = (us + 1.0f) * (gs / (1.0f + expf(-m.alpha * gs)));
                } else {
                    hv = gs / (1.0f + expf(-gs)) * us;
                }
                if (lane == 0) h[(size_t)r * m.inter + j] = hv;
            }
        }
    }
}

// out[r, i] = bf16(down(i, :) . h[r, :] (+ down_bias[i])) with any element strides.
__device__ void serve_down_strided(const float* __restrict__ h, const unsigned char* blob,
                                   const dpu_serve_model m, unsigned short* __restrict__ out,
                                   int rows, int first, int stride) {
    const int lane = threadIdx.x & 31;
    for (int i = first; i < (int)m.hidden; i += stride) {
        float acc[FFN_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) acc[r] = 0.0f;
        for (int j = lane; j < (int)m.inter; j += 32) {
            const float w = bf16_at(blob + m.down, (unsigned long long)i * m.d_si +
                                                   (unsigned long long)j * m.d_sj);
#pragma unroll
            for (int r = 0; r < FFN_MAX_ROWS; ++r)
                if (r < rows) acc[r] += w * h[(size_t)r * m.inter + j];
        }
        const float bias = m.kind == SERVE_CLAMPED ? bf16_at(blob + m.down_bias, i) : 0.0f;
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) {
            if (r < rows) {
                const float s = warp_sum(acc[r]) + bias;
                if (lane == 0) out[(size_t)r * m.hidden + i] = to_bf16(s);
            }
        }
    }
}

#endif  // DPU_SERVE_FFN_CUH
