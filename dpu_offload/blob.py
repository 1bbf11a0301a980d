"""The expert blob (docs/LAYOUT.md): an expert's tensors one after another in role order, each
starting on a ``BLOB_ALIGN``-byte boundary, the blob padded to it. The agent lays blobs out
this way (its catalog), slot pools and the arena hold them at this alignment, and the host
client reads the tensors back by role. Also how Hugging Face checkpoints name the tensors a
role comes from (the naming table): the agent's layout discovery reads names by it, the host
client's checkpoint writer writes them by it."""

from __future__ import annotations

from collections.abc import Sequence

from dpu_offload import abi

BLOB_ALIGN = 256
"""Every tensor of a blob starts on, and every blob is padded to, this many bytes."""


def pool_problem(slot_bytes: int, slot_count: int, home_layers: Sequence[int] = ()
                 ) -> str | None:
    """What is wrong with a slot pool of ``slot_count`` slots of ``slot_bytes`` (each holds
    one blob), cut into one home per layer of ``home_layers`` (none: no homes), or None: the
    agent refuses such a pool (RegisterRegion) and the client does not ask for one."""
    if slot_bytes <= 0 or slot_bytes % BLOB_ALIGN or slot_count <= 0:
        return (f"slot pool needs slot_bytes a positive multiple of {BLOB_ALIGN} and "
                f"slot_count > 0 (got {slot_bytes}, {slot_count})")
    if home_layers:
        n = len(home_layers)
        if n > slot_count or slot_count % n:
            return (f"slot pool of {slot_count} slots cannot be cut into {n} equal homes "
                    "(slot_count must be a multiple of the number of home_layers)")
        if len(set(home_layers)) != n:
            return "home_layers names a layer twice"
        bad = [layer for layer in home_layers
               if isinstance(layer, bool) or not isinstance(layer, int)
               or not 0 <= layer <= abi.MAX_KEY_FIELD]
        if bad:
            return f"home_layers: layer {bad[0]!r} is not an integer in 0..{abi.MAX_KEY_FIELD}"
    return None
ROLE_BASES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
"""The projections, in blob order: a per-expert checkpoint's gate and up lie side by side."""
ROLE_SUFFIXES = ("", "_blocks", "_scales", "_scale_inv", "_scale", "_bias")
"""A projection's parts (weights, MXFP4 blocks and scales, FP8 scales, biases), in blob
order: every projection's weights first, then each suffix."""
SWIGLU_ROLES = ("gate_proj", "up_proj", "down_proj")
"""The roles of a SwiGLU expert with per-expert tensors, gate first."""

W_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
"""Role -> its projection's name in Mixtral-style checkpoints (Mixtral, PhiMoE, MiniMax:
``block_sparse_moe.experts.{E}.w1.weight``)."""
PROJECTION_NAMES = {**{role: role for role in ROLE_BASES},
                    **{name: role for role, name in W_NAMES.items()},
                    "input_linear": "gate_up_proj", "output_linear": "down_proj"}
"""A projection's name in a checkpoint -> its role base."""
PARALLEL_PROJECTIONS = ("input_linear", "output_linear")
"""GraniteMoE's stacked experts (``block_sparse_moe.input_linear.weight`` ``[E, 2I, H]``)."""
PART_SUFFIXES = {"weight": "", ".weight": "", "": "", "weight_scale_inv": "_scale_inv",
                 ".weight_scale_inv": "_scale_inv", "_scale_inv": "_scale_inv",
                 "weight_scale": "_scale", "bias": "_bias", ".bias": "_bias", "_bias": "_bias",
                 "_blocks": "_blocks", "_scales": "_scales"}
"""The part of a tensor's name after its projection -> the role's suffix."""
PER_EXPERT_PARTS = ("weight", "weight_scale_inv", "weight_scale", "bias")
"""Parts of a per-expert tensor (``...experts.{E}.<proj>.<part>``)."""
STACKED_PROJECTIONS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
STACKED_SUFFIXES = ("", "_bias", "_blocks", "_scales", "_scale_inv")
"""A stacked tensor is ``...experts.<projection><suffix>``, experts in dimension 0."""


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
