"""How real Hugging Face MoE checkpoints name their experts: the architecture table.

Each entry reads ``config.json`` and answers which layers are MoE, how many routed and shared
experts they hold, and which checkpoint tensors (or which slice of a stacked tensor) make up one
expert, in the fixed role order of the expert blob (docs/LAYOUT.md). Adding an architecture is
one function and one line in :data:`ARCHITECTURES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class LayoutError(ValueError):
    """The checkpoint's architecture or config is not one this table recognises."""


@dataclass(frozen=True)
class TensorSource:
    """Where one role of an expert comes from.

    Attributes:
        role: the tensor's name within the expert blob (gate_proj, up_proj, ...).
        tensor: the checkpoint tensor name.
        index: for stacked (fused) tensors, the expert's index along dimension 0; else None.
    """

    role: str
    tensor: str
    index: int | None = None


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
    top_k: int = 0


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise LayoutError(f"config.json lacks {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LayoutError(f"config.json key {key!r} must be a non-negative integer, got {value!r}")
    return value


def _per_expert(prefix: str, names: list[tuple[str, str]]) -> Callable[[int, int],
                                                                       list[TensorSource]]:
    def sources(layer: int, expert: int) -> list[TensorSource]:
        base = prefix.format(layer=layer, expert=expert)
        return [TensorSource(role, f"{base}.{suffix}") for role, suffix in names]
    return sources


_SWIGLU = [("gate_proj", "gate_proj.weight"), ("up_proj", "up_proj.weight"),
           ("down_proj", "down_proj.weight")]


def _mixtral(cfg: dict[str, Any]) -> ModelLayout:
    layers = _int(cfg, "num_hidden_layers")
    return ModelLayout(
        "mixtral", tuple(range(layers)), _int(cfg, "num_local_experts"), 0,
        _per_expert("model.layers.{layer}.block_sparse_moe.experts.{expert}",
                    [("gate_proj", "w1.weight"), ("up_proj", "w3.weight"),
                     ("down_proj", "w2.weight")]),
        _int(cfg, "hidden_size"), _int(cfg, "intermediate_size"),
        _int(cfg, "num_experts_per_tok", 2))


def _qwen_moe(cfg: dict[str, Any]) -> ModelLayout:
    layers = _int(cfg, "num_hidden_layers")
    step = _int(cfg, "decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    experts = _int(cfg, "num_experts")
    moe = tuple(i for i in range(layers) if i not in dense and experts and (i + 1) % step == 0)
    shared = 1 if cfg.get("shared_expert_intermediate_size") else 0
    return ModelLayout(
        cfg["model_type"], moe, experts, shared,
        _per_expert("model.layers.{layer}.mlp.experts.{expert}", _SWIGLU),
        _int(cfg, "hidden_size"), _int(cfg, "moe_intermediate_size"),
        _int(cfg, "num_experts_per_tok", 2))


def _deepseek(cfg: dict[str, Any]) -> ModelLayout:
    layers = _int(cfg, "num_hidden_layers")
    first_dense = _int(cfg, "first_k_dense_replace", 0)
    freq = _int(cfg, "moe_layer_freq", 1) or 1
    moe = tuple(i for i in range(layers) if i >= first_dense and i % freq == 0)
    fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
    names = list(_SWIGLU)
    if fp8:
        names += [(f"{role}_scale_inv", f"{role}.weight_scale_inv") for role, _ in _SWIGLU]
    return ModelLayout(
        cfg["model_type"], moe, _int(cfg, "n_routed_experts"), _int(cfg, "n_shared_experts", 0),
        _per_expert("model.layers.{layer}.mlp.experts.{expert}", names),
        _int(cfg, "hidden_size"), _int(cfg, "moe_intermediate_size"),
        _int(cfg, "num_experts_per_tok", 8))


def _olmoe(cfg: dict[str, Any]) -> ModelLayout:
    layers = _int(cfg, "num_hidden_layers")
    return ModelLayout(
        "olmoe", tuple(range(layers)), _int(cfg, "num_experts"), 0,
        _per_expert("model.layers.{layer}.mlp.experts.{expert}", _SWIGLU),
        _int(cfg, "hidden_size"), _int(cfg, "intermediate_size"),
        _int(cfg, "num_experts_per_tok", 8))


def _stacked(prefix: str, roles: list[tuple[str, str]]) -> Callable[[int, int],
                                                                   list[TensorSource]]:
    def sources(layer: int, expert: int) -> list[TensorSource]:
        base = prefix.format(layer=layer)
        return [TensorSource(role, f"{base}.{suffix}", expert) for role, suffix in roles]
    return sources


def _gpt_oss(cfg: dict[str, Any]) -> ModelLayout:
    layers = _int(cfg, "num_hidden_layers")
    return ModelLayout(
        "gpt_oss", tuple(range(layers)), _int(cfg, "num_local_experts"), 0,
        _stacked("model.layers.{layer}.mlp.experts",
                 [("gate_up_proj", "gate_up_proj"), ("gate_up_proj_bias", "gate_up_proj_bias"),
                  ("down_proj", "down_proj"), ("down_proj_bias", "down_proj_bias")]),
        _int(cfg, "hidden_size"), _int(cfg, "intermediate_size"),
        _int(cfg, "num_experts_per_tok", 4))


def _llama4(cfg: dict[str, Any]) -> ModelLayout:
    text = cfg.get("text_config", cfg)
    layers = _int(text, "num_hidden_layers")
    step = _int(text, "interleave_moe_layer_step", 1) or 1
    moe = tuple(i for i in range(layers) if (i + 1) % step == 0)
    prefix = ("language_model.model.layers.{layer}.feed_forward.experts"
              if "text_config" in cfg else "model.layers.{layer}.feed_forward.experts")
    return ModelLayout(
        "llama4", moe, _int(text, "num_local_experts"), 1,
        _stacked(prefix, [("gate_up_proj", "gate_up_proj"), ("down_proj", "down_proj")]),
        _int(text, "hidden_size"), _int(text, "intermediate_size"),
        _int(text, "num_experts_per_tok", 1))


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], ModelLayout]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
}
"""``config.json`` ``model_type`` -> layout reader."""


def layout_for(cfg: dict[str, Any]) -> ModelLayout:
    """The layout of a checkpoint from its parsed ``config.json``."""
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise LayoutError(f"unrecognised model_type {model_type!r} in config.json; known: "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type](cfg)
