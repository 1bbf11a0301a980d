"""The combine of an MoE layer on the host CPU, compiled with Numba: the twin of
``dpu_combine_bf16`` (moe_ops.cu) that an activation sender without a GPU uses
(:class:`host_client.activations.ActivationSender`), bit-equal to ``reference.combine_bf16``
wherever the result is a number (a NaN's payload may differ).

The NumPy twin gathers, widens and weighs a whole ``[tokens, d]`` block per choice ``k``: for
128 tokens at hidden 7168 about 9 MB of fresh temporaries each, 70 MB a layer, which the
kernel maps and faults in again on every call. On the H100 VM of the forty-third session
that was most of the MoE layer's 47 ms through the activation path (py-spy of
bench/activations.py: ``combine_bf16`` ~70 % of the sender's ``dispatch`` samples). Here each
expert output row is read once and each result row written once.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dpu_offload.jit import keep_cache
from gpu_kernels.routing import DispatchPlan

keep_cache(__file__)


@njit(cache=True)
def _combine(expert_out: np.ndarray, rows: np.ndarray, weights: np.ndarray,
             out: np.ndarray) -> None:
    tokens, top_k = weights.shape
    d = expert_out.shape[1]
    acc = np.empty(d, np.float32)
    wide = np.empty(d, np.uint32)
    widef = wide.view(np.float32)
    accu = acc.view(np.uint32)
    for t in range(tokens):
        acc[:] = 0.0
        for k in range(top_k):
            w = weights[t, k]
            src = expert_out[rows[t, k]]
            for j in range(d):
                wide[j] = np.uint32(src[j]) << np.uint32(16)
            for j in range(d):  # a product, then a sum, each rounded: no fused multiply-add
                acc[j] = acc[j] + w * widef[j]
        for j in range(d):
            u = accu[j]
            out[t, j] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16))
                                                            & np.uint32(1))) >> np.uint32(16))


def combine_bf16(expert_out: np.ndarray, plan: DispatchPlan, weights: np.ndarray
                 ) -> np.ndarray:
    """``expert_out`` (bf16 bits, ``uint16[tokens * top_k, d]``, packed as ``plan`` says)
    weighted by ``weights`` (``float32[tokens, top_k]``) and summed over k in order, in fp32;
    returns bf16 bits ``uint16[tokens, d]``, equal bit for bit to
    ``reference.combine_bf16`` wherever the result is a number."""
    tokens, top_k = weights.shape
    if expert_out.dtype != np.uint16 or expert_out.ndim != 2 \
            or expert_out.shape[0] != tokens * top_k:
        raise ValueError(f"expert_out must be uint16[{tokens * top_k}, d], got "
                         f"{expert_out.dtype}{list(expert_out.shape)}")
    out = np.empty((tokens, expert_out.shape[1]), np.uint16)
    _combine(np.ascontiguousarray(expert_out), plan.inverse.reshape(tokens, top_k),
             np.ascontiguousarray(weights, np.float32), out)
    return out
