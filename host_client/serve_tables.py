"""The tables the resident receiver (gpu_kernels/serve.cu) reads, as NumPy dtypes, and how a
model's expert layout becomes its entry: the contract between that kernel and its host side
(host_client/resident.py), NumPy only so that it can be checked anywhere.
"""

from __future__ import annotations

import numpy as np

from dpu_offload.v1 import agent_pb2 as pb
from host_client.memory import tensor_layout

REGION_DTYPE = np.dtype([("base", "<u8"), ("size", "<u8")])
MODEL_DTYPE = np.dtype([
    ("gate", "<u8"), ("up", "<u8"), ("down", "<u8"), ("blob_bytes", "<u8"), ("gate_bias", "<u8"),
    ("up_bias", "<u8"), ("down_bias", "<u8"), ("hidden", "<u4"), ("inter", "<u4"),
    ("kind", "<u4"), ("g_sj", "<u4"), ("g_sk", "<u4"), ("d_si", "<u4"), ("d_sj", "<u4"),
    ("b_s", "<u4"), ("alpha", "<f4"), ("limit", "<f4")])
CONTIGUOUS, STRIDED, CLAMPED = 1, 2, 3
"""``SERVE_*`` of serve_ffn.cuh: how a model's experts lie in their blobs (0: not computed)."""
"""``dpu_serve_region`` (serve.cu) and ``dpu_serve_model`` (serve_ffn.cuh)."""
CTL_DTYPE = np.dtype([
    ("barrier_count", "<u4"), ("barrier_gen", "<u4"), ("action", "<u4"), ("status", "<u4"),
    ("pos", "<u8"), ("part_n", "<u8"), ("nid", "<u8"), ("total", "<u8"), ("slot", "<u8"),
    ("done", "<u8"), ("first", "<u8"), ("end", "<u8"), ("tx_pos", "<u8"), ("answer", "<u8"),
    ("model", "<u4"), ("layer", "<u4"), ("expert", "<u4"), ("whole", "<u4"), ("skip", "<u4"),
    ("reason", "<u4"), ("written", "<u8"), ("refused", "<u8"), ("served", "<u8"),
    ("failed", "<u8"), ("refused_packets", "<u8")])
"""``dpu_serve_ctl``: the kernel's state between steps and its counters."""


def model_entry(manifest: pb.ExpertManifest) -> np.void:
    """The kernel's view of a model's expert layout (``kind`` 0 where it does not compute it):
    per-expert ``gate_proj`` / ``up_proj`` [I, H] and ``down_proj`` [H, I], or transformers 5's
    fused ``gate_up_proj`` [2I, H] (row-major: 16-byte loads); Llama-4's ``gate_up_proj``
    [H, 2I] with ``down_proj`` [I, H] (strided); gpt-oss's BF16 ``gate_up_proj`` [H, 2I] with
    gate and up interleaved, its biases and ``down_proj`` [I, H] (clamped SwiGLU). MXFP4 and
    FP8 stay with the host-thread path."""
    e = np.zeros(1, MODEL_DTYPE)[0]
    e["blob_bytes"] = manifest.blob_bytes
    t = {x.name: tensor_layout(manifest, x.name) for x in manifest.tensors}
    if any(x.dtype != "BF16" for x in t.values()) or "down_proj" not in t:
        return e
    d = t["down_proj"]
    if manifest.activation == pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU:
        if set(t) != {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}:
            return e
        gu = t["gate_up_proj"]
        (h, two_i), (i, h2) = gu.shape, d.shape
        if two_i != 2 * i or h2 != h:
            return e
        e["gate"], e["up"], e["g_sj"], e["g_sk"] = gu.offset, gu.offset + 2, 2, two_i
        e["gate_bias"], e["up_bias"], e["b_s"] = t["gate_up_proj_bias"].offset, \
            t["gate_up_proj_bias"].offset + 2, 2
        e["down_bias"] = t["down_proj_bias"].offset
        e["alpha"], e["limit"], e["kind"] = manifest.swiglu_alpha, manifest.swiglu_limit, CLAMPED
    elif any(n.endswith("_bias") for n in t):
        return e
    else:
        try:
            gu = tensor_layout(manifest, "gate_up_proj")
        except KeyError:
            return e
        (a, b), (c, dd) = gu.shape, d.shape
        if a == 2 * dd and b == c:  # [2I, H] and [H, I]
            h, i = b, dd
            e["gate"], e["up"], e["kind"] = gu.offset, gu.offset + i * h * 2, CONTIGUOUS
            e["g_sj"], e["g_sk"] = h, 1
        elif b == 2 * c and a == dd:  # Llama-4: [H, 2I] and [I, H]
            h, i = a, c
            e["gate"], e["up"], e["kind"] = gu.offset, gu.offset + i * 2, STRIDED
            e["g_sj"], e["g_sk"] = 1, b
        else:
            return e
    e["down"], e["hidden"], e["inter"] = d.offset, h, i
    e["d_si"], e["d_sj"] = (i, 1) if e["kind"] == CONTIGUOUS else (1, h)
    if h % 8 or i % 8:
        e["kind"] = 0
    return e
