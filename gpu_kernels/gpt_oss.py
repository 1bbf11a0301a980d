"""gpt-oss's expert arithmetic, on NumPy or CuPy arrays alike (no kernel of its own: the expert
worker runs it on the CPU reference device and, through cuBLAS, on a GPU): MXFP4 weights as
gpt-oss ships them, and its clamped SwiGLU (docs/LAYOUT.md, "Activation").
"""

from __future__ import annotations

import numpy as np

from gpu_kernels.reference import array_module, bf16_to_f32, f32_to_bf16

MXFP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""The FP4 (E2M1) value of each 4-bit code."""


def mxfp4_to_f32(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 as gpt-oss ships it -> float32: ``blocks`` ``uint8[..., G, 16]`` (two FP4 codes
    a byte, the low nibble first: 32 values a block) and ``scales`` ``uint8[..., G]`` (one
    power of two a block, biased by 127) -> ``float32[..., G * 32]``; NumPy or CuPy. ValueError
    for shapes that do not pair (a scale per block, 16 bytes a block)."""
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         "are not [..., G, 16] and [..., G]")
    xp = array_module(blocks)
    lut = xp.asarray(MXFP4_VALUES)
    values = xp.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = lut[blocks & 0x0F]
    values[..., 1::2] = lut[blocks >> 4]
    exponents = scales.astype(np.int32)[..., None] - 127
    return xp.ldexp(values, exponents).reshape(*blocks.shape[:-2], -1)


def clamped_swiglu_f32_weights(x: np.ndarray, gate: np.ndarray, up: np.ndarray,
                               down: np.ndarray, gate_bias: np.ndarray, up_bias: np.ndarray,
                               down_bias: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss's expert FFN (transformers' ``GptOssExperts``) per row, fp32 math, bf16 bits
    in and out; NumPy or CuPy arrays (all of one kind), weights already widened to float32 and
    oriented for ``rows @ weight`` (contiguous: BLAS reads them in storage order):
    ``g = min(x @ gate + gate_bias, limit)``, ``u = clip(x @ up + up_bias, -limit, limit)``,
    ``out = ((u + 1) * g * sigmoid(alpha * g)) @ down + down_bias``.

    Args:
        x: ``uint16[rows, hidden]``; gate, up: ``float32[hidden, inter]``; down:
            ``float32[inter, hidden]``; gate_bias, up_bias: ``float32[inter]``; down_bias:
            ``float32[hidden]``.
    """
    xp = array_module(x)
    xf = bf16_to_f32(x)
    g = xp.minimum(xf @ gate + gate_bias, np.float32(limit))
    u = xp.clip(xf @ up + up_bias, np.float32(-limit), np.float32(limit))
    h = (u + 1) * (g / (1 + xp.exp(-np.float32(alpha) * g)))
    return f32_to_bf16(h @ down + down_bias)
