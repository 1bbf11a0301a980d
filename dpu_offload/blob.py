"""The expert blob (docs/LAYOUT.md): an expert's tensors one after another in role order, each
starting on a ``BLOB_ALIGN``-byte boundary, the blob padded to it. The agent lays blobs out
this way (its catalog), slot pools and the arena hold them at this alignment, and the host
client reads the tensors back by role."""

from __future__ import annotations

BLOB_ALIGN = 256
"""Every tensor of a blob starts on, and every blob is padded to, this many bytes."""
ROLE_BASES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
"""The projections, in blob order: a per-expert checkpoint's gate and up lie side by side."""
ROLE_SUFFIXES = ("", "_blocks", "_scales", "_scale_inv", "_scale", "_bias")
"""A projection's parts (weights, MXFP4 blocks and scales, FP8 scales, biases), in blob
order: every projection's weights first, then each suffix."""
SWIGLU_ROLES = ("gate_proj", "up_proj", "down_proj")
"""The roles of a SwiGLU expert with per-expert tensors, gate first."""


def align_up(n: int, a: int = BLOB_ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a`` (bytes)."""
    return (n + a - 1) // a * a


def role_order(role: str) -> tuple[int, int]:
    """Sort key of a blob role: weights of every projection first, then each suffix."""
    if role in ROLE_BASES:
        return 0, ROLE_BASES.index(role)
    for s, suffix in enumerate(ROLE_SUFFIXES[1:], 1):
        if role.endswith(suffix) and role[:-len(suffix)] in ROLE_BASES:
            return s, ROLE_BASES.index(role[:-len(suffix)])
    return len(ROLE_SUFFIXES), 0
