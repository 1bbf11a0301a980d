// One expert's SwiGLU FFN for a few rows (decode: one token per sequence), in two launches
// (the formula and its twin: ffn.cuh). One warp per output column.
#include "ffn.cuh"

// x: uint4[rows * hidden8]; gate, up: uint4[inter * hidden8]; h: float[rows * inter].
extern "C" __global__ void dpu_ffn_gate_up(const uint4* __restrict__ x,
                                           const uint4* __restrict__ gate,
                                           const uint4* __restrict__ up,
                                           float* __restrict__ h, int rows, int hidden8,
                                           int inter) {
    const int warps = blockDim.x >> 5;
    dpu_ffn_gate_up_rows(x, gate, up, h, rows, hidden8, inter,
                         blockIdx.x * warps + (threadIdx.x >> 5), gridDim.x * warps);
}

// h: float4[rows * inter8 * 2]; down: uint4[hidden * inter8]; out: bf16 bits[rows * hidden].
extern "C" __global__ void dpu_ffn_down(const float4* __restrict__ h,
                                        const uint4* __restrict__ down,
                                        unsigned short* __restrict__ out, int rows, int inter8,
                                        int hidden) {
    const int warps = blockDim.x >> 5;
    dpu_ffn_down_rows(h, down, out, rows, inter8, hidden,
                      blockIdx.x * warps + (threadIdx.x >> 5), gridDim.x * warps);
}
