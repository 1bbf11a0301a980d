// The SwiGLU FFN of one expert over up to FFN_MAX_ROWS rows, as device functions shared by the
// two-launch FFN (expert_ffn.cu) and the resident receiver (serve.cu):
//   h[r, j]   = silu(gate[j, :] . x[r, :]) * (up[j, :] . x[r, :])      (float32)
//   out[r, i] = bf16(down[i, :] . h[r, :])
// Weights and x are bf16 bits (uint16), read 8 values (16 bytes) at a time; math in float32.
// One warp per output column: the caller's warp `first` takes columns first, first + stride...
// Memory bound on the weights, which every row of x shares. Twin: reference.swiglu_bf16 (same
// formula; summation order differs, so results agree to float32 rounding before the final
// bf16 rounding).
#ifndef DPU_FFN_CUH
#define DPU_FFN_CUH

#define FFN_MAX_ROWS 8

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }

// Sum of the 8 products of two vectors of 8 bf16 values.
__device__ __forceinline__ float dot8(const uint4 a, const uint4 b) {
    return bf16_lo(a.x) * bf16_lo(b.x) + bf16_hi(a.x) * bf16_hi(b.x)
         + bf16_lo(a.y) * bf16_lo(b.y) + bf16_hi(a.y) * bf16_hi(b.y)
         + bf16_lo(a.z) * bf16_lo(b.z) + bf16_hi(a.z) * bf16_hi(b.z)
         + bf16_lo(a.w) * bf16_lo(b.w) + bf16_hi(a.w) * bf16_hi(b.w);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Round to nearest even, as reference.f32_to_bf16.
__device__ __forceinline__ unsigned short to_bf16(float f) {
    const unsigned u = __float_as_uint(f);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// x: uint4[rows * hidden8]; gate, up: uint4[inter * hidden8]; h: float[rows * inter].
__device__ void dpu_ffn_gate_up_rows(const uint4* __restrict__ x, const uint4* __restrict__ gate,
                                     const uint4* __restrict__ up, float* __restrict__ h,
                                     int rows, int hidden8, int inter, int first, int stride) {
    const int lane = threadIdx.x & 31;
    for (int j = first; j < inter; j += stride) {
        float g[FFN_MAX_ROWS], u[FFN_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) g[r] = u[r] = 0.0f;
        const uint4* grow = gate + (size_t)j * hidden8;
        const uint4* urow = up + (size_t)j * hidden8;
        for (int k = lane; k < hidden8; k += 32) {
            const uint4 gw = grow[k];
            const uint4 uw = urow[k];
#pragma unroll
            for (int r = 0; r < FFN_MAX_ROWS; ++r) {
                if (r < rows) {
                    const uint4 xv = x[(size_t)r * hidden8 + k];
                    g[r] += dot8(gw, xv);
                    u[r] += dot8(uw, xv);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) {
            if (r < rows) {
                const float gs = warp_sum(g[r]);
                const float us = warp_sum(u[r]);
                if (lane == 0) h[(size_t)r * inter + j] = gs / (1.0f + expf(-gs)) * us;
            }
        }
    }
}

// h: float4[rows * inter8 * 2]; down: uint4[hidden * inter8]; out: bf16 bits[rows * hidden].
__device__ void dpu_ffn_down_rows(const float4* __restrict__ h, const uint4* __restrict__ down,
                                  unsigned short* __restrict__ out, int rows, int inter8,
                                  int hidden, int first, int stride) {
    const int lane = threadIdx.x & 31;
    for (int i = first; i < hidden; i += stride) {
        float acc[FFN_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) acc[r] = 0.0f;
        const uint4* drow = down + (size_t)i * inter8;
        for (int k = lane; k < inter8; k += 32) {
            const uint4 w = drow[k];
#pragma unroll
            for (int r = 0; r < FFN_MAX_ROWS; ++r) {
                if (r < rows) {
                    const float4 a = h[((size_t)r * inter8 + k) * 2];
                    const float4 b = h[((size_t)r * inter8 + k) * 2 + 1];
                    acc[r] += bf16_lo(w.x) * a.x + bf16_hi(w.x) * a.y
                            + bf16_lo(w.y) * a.z + bf16_hi(w.y) * a.w
                            + bf16_lo(w.z) * b.x + bf16_hi(w.z) * b.y
                            + bf16_lo(w.w) * b.z + bf16_hi(w.w) * b.w;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < FFN_MAX_ROWS; ++r) {
            if (r < rows) {
                const float s = warp_sum(acc[r]);
                if (lane == 0) out[(size_t)r * hidden + i] = to_bf16(s);
            }
        }
    }
}

#endif  // DPU_FFN_CUH
