"""How a MoE checkpoint names its experts, discovered from its tensor names (and shapes, when
the shards are there), with ``config.json`` for the numbers. No architecture gate: any
``model_type`` whose tensors follow one of the two forms every MoE family uses is accepted.

- **per-expert**: ``<prefix>layers.{L}.<block>.experts.{E}.<proj>.<part>``, e.g.
  ``model.layers.3.mlp.experts.7.gate_proj.weight`` (Qwen, DeepSeek, OLMoE as saved by
  transformers), ``...block_sparse_moe.experts.7.w1.weight`` (Mixtral, PhiMoE, MiniMax); FP8 adds
  ``.weight_scale_inv``.
- **stacked**: one tensor per role with the experts in dimension 0,
  ``<prefix>layers.{L}.<block>.experts.<proj><part>``: transformers 5's fused form
  (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), gpt-oss and
  Llama-4 (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``, biases, MXFP4 ``_blocks``
  / ``_scales``), GraniteMoE (``input_linear`` / ``output_linear``).

Roles in an expert blob (docs/LAYOUT.md): ``gate_proj``, ``up_proj``, ``gate_up_proj``,
``down_proj``, each with an optional suffix ``_blocks``, ``_scales``, ``_scale_inv``, ``_scale``,
``_bias``; weights first, so a blob's gate and up lie side by side.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dpu_offload.blob import (
    PARALLEL_PROJECTIONS,
    PART_SUFFIXES,
    PER_EXPERT_PARTS,
    PROJECTION_NAMES,
    ROLE_BASES,
    STACKED_PROJECTIONS,
    STACKED_SUFFIXES,
    role_order,
)


class LayoutError(ValueError):
    """The checkpoint's experts or config cannot be read as a MoE layout; says what was seen
    and what was expected."""


@dataclass(frozen=True)
class TensorSource:
    """Where one role of an expert comes from.

    Attributes:
        role: the tensor's name within the expert blob (gate_proj, up_proj, ...).
        tensor: the checkpoint tensor name.
        index: for stacked tensors, the expert's index along dimension 0; else None.
    """

    role: str
    tensor: str
    index: int | None = None


@dataclass(frozen=True)
class Activation:
    """How an expert's FFN combines its projections (docs/LAYOUT.md, "Activation").

    ``swiglu``: ``down @ (silu(gate @ x) * (up @ x))``. ``clamped_swiglu`` (gpt-oss): gate
    and up interleaved in ``gate_up_proj`` (even columns gate, odd up), each projection with
    its bias, gate clamped above at ``limit`` and up to ``[-limit, limit]``, then
    ``down @ ((up + 1) * gate * sigmoid(alpha * gate)) + down_bias``.
    """

    kind: str = "swiglu"
    alpha: float = 0.0
    limit: float = 0.0


SWIGLU = Activation()
CLAMPED_SWIGLU_DEFAULTS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
"""gpt-oss's constants, as its transformers config defaults them (config.json may omit them)."""


@dataclass(frozen=True)
class ModelLayout:
    """What the catalog needs to know of one checkpoint's MoE structure."""

    architecture: str
    moe_layers: tuple[int, ...]
    experts_per_layer: int
    shared_experts_per_layer: int
    expert_sources: Callable[[int, int], list[TensorSource]] = field(repr=False)
    """(layer, expert) -> the roles of that expert in blob order."""
    hidden_size: int = 0
    intermediate_size: int = 0
    """One expert's intermediate size (I), from the config."""
    top_k: int = 0
    pattern: str = ""
    """The names the experts were found under, e.g.
    ``model.layers.{L}.mlp.experts.{E}.{gate_proj,up_proj,down_proj}.weight``."""
    stacked: bool = False
    """Whether each role is one ``[E, ...]`` tensor per layer."""
    in_out: bool = False
    """Stacked weights stored ``[E, in, out]`` (gpt-oss, Llama-4: ``gate_up_proj`` ``[E, H,
    2I]``) rather than ``[E, out, in]`` like ``nn.Linear`` (transformers 5's fused form)."""
    activation: Activation = SWIGLU


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config keys of the routed-expert count, as transformers versions and families spell it."""
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts")
IN_OUT_TYPES = frozenset({"gpt_oss", "llama4", "llama4_text"})
"""Families whose stacked weights are ``[E, in, out]``; used only where the shapes cannot tell
(a square ``gate_up_proj``)."""

_SHARED = re.compile(r"\.shared_experts?\.")


MAX_INDEX = 1 << 16
"""Layers and experts per layer a checkpoint may have (a tensor name or config key beyond it
is refused before any work is sized by it)."""
MAX_SIZE = 1 << 20
"""Largest hidden or intermediate size accepted from a config."""


def first_int(cfg: Mapping[str, Any], keys: tuple[str, ...], what: str,
              default: int | None = None, limit: int = MAX_INDEX) -> int:
    """The first of ``keys`` present in ``cfg``, an integer in [0, ``limit``]; LayoutError
    naming every spelling looked for when none is there (and no default)."""
    for key in keys:
        if cfg.get(key) is not None:
            value = cfg[key]
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
                raise LayoutError(f"config.json key {key!r} ({what}) must be an integer in "
                                  f"[0, {limit}], got {value!r}"[:300])
            return value
    if default is None:
        raise LayoutError(f"config.json gives no {what} (looked for {', '.join(keys)})")
    return default


def activation_of(text: Mapping[str, Any], model_type: str, roles: Iterable[str]
                  ) -> Activation:
    """The experts' activation: ``clamped_swiglu`` for experts with a ``gate_up_proj_bias``
    in a gpt-oss config (``model_type`` ``gpt_oss``, or ``swiglu_limit`` given), with its
    ``swiglu_alpha`` and ``swiglu_limit`` (positive, finite; LayoutError naming the key
    otherwise); ``swiglu`` for every other expert."""
    if "gate_up_proj_bias" not in roles or (model_type != "gpt_oss"
                                            and "swiglu_limit" not in text):
        return SWIGLU
    values = []
    for key, default in CLAMPED_SWIGLU_DEFAULTS.items():
        value = text.get(key, default)
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not math.isfinite(value) or not 0 < value <= 1e4):
            raise LayoutError(f"config.json key {key!r} must be a positive number up to "
                              f"1e4, got {value!r}"[:300])
        values.append(float(value))
    return Activation("clamped_swiglu", *values)


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: ``text_config`` of a multimodal wrapper, else ``cfg``."""
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


@dataclass
class _Layer:
    block: str
    stacked: bool
    roles: dict[str, str] = field(default_factory=dict)
    """role -> tensor name (stacked) or ``<proj>.<part>`` after the expert index."""
    experts: dict[int, set[str]] = field(default_factory=dict)


def _parse(name: str) -> tuple[str, int, int | None, str, str] | None:
    """(block, layer, expert or None for stacked, proj, part) of an expert tensor's name;
    None for any other tensor. Split, not a regular expression: a checkpoint has ~10^5 names."""
    parts = name.split(".")
    try:
        at = len(parts) - 1 - parts[::-1].index("experts")
    except ValueError:
        at = -1
    tail = parts[at + 1:] if at >= 0 else []
    if len(tail) == 3 and tail[0].isdigit() and tail[2] in PER_EXPERT_PARTS:
        expert, proj, part = int(tail[0]), tail[1], tail[2]
        if expert >= MAX_INDEX:
            raise LayoutError(f"expert tensor {name[:200]!r}: expert index {expert} is not below "
                              f"{MAX_INDEX}")
    elif at >= 0 and len(tail) in (1, 2):
        expert = None
        proj, part = tail[0], "." + tail[1] if len(tail) == 2 else ""
        if part not in ("", ".weight", ".bias", ".weight_scale_inv"):
            return None
        if not part:
            base = next((p for p in STACKED_PROJECTIONS if proj.startswith(p)
                         and proj[len(p):] in STACKED_SUFFIXES), None)
            if base is None:
                return None
            proj, part = base, proj[len(base):]
        elif proj not in STACKED_PROJECTIONS:
            return None
    elif len(parts) >= 2 and parts[-2] in PARALLEL_PROJECTIONS and parts[-1] == "weight":
        at, expert, proj, part = len(parts) - 3, None, parts[-2], ".weight"
    else:
        return None
    layer = next((int(parts[k + 1]) for k in range(at - 1, -1, -1)
                  if parts[k] == "layers" and parts[k + 1].isdigit()), None)
    if layer is None:
        return None
    if layer >= MAX_INDEX:
        raise LayoutError(f"expert tensor {name[:200]!r}: layer {layer} is not below "
                          f"{MAX_INDEX}")
    return ".".join(parts[:at + 1]), layer, expert, proj, part


def _role(name: str, proj: str, part: str) -> str:
    base = PROJECTION_NAMES.get(proj)
    if base is None:
        raise LayoutError(f"expert tensor {name!r}: projection {proj!r} is none of "
                          f"{', '.join(sorted(PROJECTION_NAMES))}")
    return base + PART_SUFFIXES[part]


def _scan(names: list[str]) -> dict[int, _Layer]:
    layers: dict[int, _Layer] = {}
    roles: dict[tuple[str, str], str] = {}
    """(proj, part) -> role, computed once per spelling."""
    for name in names:
        parsed = _parse(name)
        if parsed is None or _SHARED.search(name):
            continue
        block, layer, expert, proj, part = parsed
        role = roles.get((proj, part)) or roles.setdefault((proj, part), _role(name, proj, part))
        stacked = expert is None
        got = layers.get(layer)
        if got is None:
            got = layers[layer] = _Layer(block, stacked)
        elif got.block != block or got.stacked != stacked:
            raise LayoutError(f"layer {layer} holds experts in two forms: under "
                              f"{got.block!r} and in {name!r}")
        if expert is None:
            if role in got.roles:
                raise LayoutError(f"layer {layer}: {got.roles[role]!r} and {name!r} are both "
                                  f"its {role}")
            got.roles[role] = name
        else:
            got.roles[role] = f"{proj}.{part}"
            held = got.experts.get(expert)
            if held is None:
                got.experts[expert] = {role}
            else:
                held.add(role)
    return layers


def _pattern(layers: dict[int, _Layer]) -> str:
    """One name pattern for every layer; LayoutError when layers differ."""
    patterns = {}
    for layer, got in layers.items():
        block = re.sub(rf"layers\.{layer}\.", "layers.{L}.", got.block, count=1)
        roles = ",".join(sorted(got.roles, key=role_order))
        patterns[layer] = (f"{block}.{{{roles}}}" if got.stacked
                           else f"{block}.{{E}}.{{{','.join(sorted(set(got.roles.values())))}}}")
    distinct = sorted(set(patterns.values()))
    if len(distinct) > 1:
        raise LayoutError(f"MoE layers name their experts differently: {distinct[:3]}")
    return distinct[0]


def _expert_count(cfg: Mapping[str, Any], layers: dict[int, _Layer],
                  shapes: Mapping[str, tuple[int, ...] | None]) -> int:
    named = None
    got = next(iter(layers.values()))
    if not got.stacked:
        named = max(got.experts) + 1
    else:
        dims = {shapes.get(t) for t in got.roles.values()} - {None}
        named = next(iter(dims))[0] if dims else None
    configured = first_int(cfg, EXPERT_COUNT_KEYS, "routed-expert count", default=-1)
    if configured < 0:
        if named is None:
            raise LayoutError("config.json gives no routed-expert count (looked for "
                              f"{', '.join(EXPERT_COUNT_KEYS)}) and the shards that would "
                              "tell are absent")
        return named
    # Per-expert names short of the count are a missing expert (_check_experts names it).
    if named is not None and (named > configured or (got.stacked and named != configured)):
        raise LayoutError(f"config.json says {configured} experts per layer, the tensors "
                          f"hold {named}")
    return configured


def _check_experts(layers: dict[int, _Layer], experts: int) -> None:
    for layer, got in sorted(layers.items()):
        roles = set(got.roles)
        bases = {ROLE_BASES[role_order(r)[1]] for r in roles}  # gate_up_proj_blocks: gate_up_proj
        if not ({"down_proj"} <= bases and ({"gate_proj", "up_proj"} <= bases
                                            or "gate_up_proj" in bases)):
            raise LayoutError(f"layer {layer}: expert tensors {sorted(roles)} lack a down "
                              "projection and gate and up (or a fused gate_up) projections")
        for e in range(experts) if not got.stacked else ():
            if got.experts.get(e) != roles:
                missing = sorted(roles - got.experts.get(e, set()), key=role_order)
                raise LayoutError(f"layer {layer} expert {e} lacks "
                                  + ", ".join(f"{got.block}.{e}.{got.roles[r]}" for r in missing))


def _in_out(model_type: str, got: _Layer, shapes: Mapping[str, tuple[int, ...] | None],
            hidden: int) -> bool:
    shape = shapes.get(got.roles.get("gate_up_proj", got.roles.get("down_proj", "")))
    if shape is not None and len(shape) == 3 and shape[1] != shape[2] and hidden:
        fused = "gate_up_proj" in got.roles
        return shape[1] == hidden if fused else shape[2] == hidden
    return model_type in IN_OUT_TYPES


def discover(cfg: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...] | None]
             ) -> ModelLayout:
    """The MoE layout of a checkpoint from its parsed ``config.json`` and its tensors
    (name -> shape, None where the shard is absent). LayoutError says what was seen and what
    was expected."""
    text = text_config(cfg)
    model_type = str(text.get("model_type") or cfg.get("model_type") or "unknown")
    layers = _scan(sorted(shapes))
    if not layers:
        sample = sorted(shapes)[:3]
        raise LayoutError(
            f"no expert tensors in this checkpoint (model_type {model_type!r}): expected names "
            "like '...layers.{L}.<block>.experts.{E}.<gate_proj|w1|...>.weight' or stacked "
            f"'...layers.{{L}}.<block>.experts.<gate_up_proj|down_proj>'; saw e.g. {sample}")
    pattern = _pattern(layers)
    experts = _expert_count(text, layers, shapes)
    _check_experts(layers, experts)
    hidden = first_int(text, ("hidden_size",), "hidden size", default=0, limit=MAX_SIZE)
    shared = first_int(text, SHARED_COUNT_KEYS, "shared-expert count", default=-1)
    if shared < 0:
        shared = 1 if (text.get("shared_expert_intermediate_size")
                       or any(_SHARED.search(n) for n in shapes)) else 0
    first = next(iter(layers.values()))
    order = {layer: sorted(got.roles, key=role_order) for layer, got in layers.items()}

    def sources(layer: int, expert: int) -> list[TensorSource]:
        got = layers[layer]
        if got.stacked:
            return [TensorSource(r, got.roles[r], expert) for r in order[layer]]
        return [TensorSource(r, f"{got.block}.{expert}.{got.roles[r]}") for r in order[layer]]

    return ModelLayout(
        model_type, tuple(sorted(layers)), experts, shared, sources, hidden,
        first_int(text, INTERMEDIATE_KEYS, "expert intermediate size", default=0,
                  limit=MAX_SIZE),
        first_int(text, TOP_K_KEYS, "experts per token", default=0), pattern, first.stacked,
        first.stacked and _in_out(model_type, first, shapes, hidden),
        activation_of(text, model_type, first.roles))
