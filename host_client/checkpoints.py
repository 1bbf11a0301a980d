"""Small checkpoints in real Hugging Face layouts, with seeded random weights (``expertctl
make-checkpoint``): config.json, model.safetensors.index.json and sharded .safetensors files
named exactly as transformers 5 ``save_pretrained`` names them (and, as options, its fused form
and the config keys transformers 4 wrote). For tests, demos and benchmarks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors

from dpu_offload.blob import SWIGLU_ROLES, W_NAMES

ARCHS = ("qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v3", "olmoe", "gpt-oss")


@dataclass(frozen=True)
class CheckpointSpec:
    """Shape of a synthetic checkpoint."""

    arch: str
    layers: int = 4
    experts: int = 8
    hidden: int = 256
    intermediate: int = 128
    dtype: str = "bf16"
    top_k: int = 2
    seed: int = 0
    dense_layers: int = 1
    """DeepSeek only: leading dense layers (``first_k_dense_replace``)."""
    fused: bool = False
    """Write each layer's experts stacked, as transformers 5 saves with
    ``save_original_format=False``: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows,
    then up rows) and ``mlp.experts.down_proj`` ``[E, H, I]`` (not for gpt-oss, always
    stacked)."""
    legacy_config: bool = False
    """Spell Qwen3-MoE's expert count ``num_experts``, as transformers 4 wrote it (5 writes
    ``num_local_experts``)."""


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            ).astype(np.uint16)


def _weights(rng: np.random.Generator, shape: tuple[int, ...], dtype: str
             ) -> tuple[str, np.ndarray]:
    if dtype == "fp8":
        raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0  # no NaN encodings in E4M3
        return "F8_E4M3", raw
    if dtype == "f32":
        return "F32", (rng.standard_normal(shape, dtype=np.float32) * 0.02)
    return "BF16", _bf16(rng.standard_normal(shape, dtype=np.float32) * 0.02)


def _config(spec: CheckpointSpec) -> dict:
    torch_dtype = {"bf16": "bfloat16", "fp8": "bfloat16", "f32": "float32"}[spec.dtype]
    common = {"num_hidden_layers": spec.layers, "hidden_size": spec.hidden,
              "num_experts_per_tok": spec.top_k, "torch_dtype": torch_dtype,
              "vocab_size": 1024}
    if spec.arch == "mixtral":
        return {**common, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "num_local_experts": spec.experts, "intermediate_size": spec.intermediate}
    if spec.arch in ("qwen3-moe", "qwen2-moe"):
        mt = spec.arch.replace("-", "_")
        count = "num_experts" if mt == "qwen2_moe" or spec.legacy_config else "num_local_experts"
        cfg = {**common, "model_type": mt, count: spec.experts,
               "moe_intermediate_size": spec.intermediate, "decoder_sparse_step": 1,
               "mlp_only_layers": [], "intermediate_size": spec.intermediate * 4,
               "architectures": ["Qwen3MoeForCausalLM" if mt == "qwen3_moe"
                                 else "Qwen2MoeForCausalLM"]}
        if mt == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = spec.intermediate * 2
        return cfg
    if spec.arch == "deepseek-v3":
        cfg = {**common, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
               "n_routed_experts": spec.experts, "n_shared_experts": 1,
               "moe_intermediate_size": spec.intermediate, "first_k_dense_replace":
               spec.dense_layers, "moe_layer_freq": 1, "intermediate_size": spec.intermediate * 4}
        if spec.dtype == "fp8":
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
        return cfg
    if spec.arch == "olmoe":
        return {**common, "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"],
                "num_experts": spec.experts, "intermediate_size": spec.intermediate}
    if spec.arch == "gpt-oss":
        return {**common, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                "num_local_experts": spec.experts, "intermediate_size": spec.intermediate}
    raise ValueError(f"unknown architecture {spec.arch!r}; choose from {', '.join(ARCHS)}")


def expert_tensor_names(arch: str, layer: int, expert: int) -> dict[str, str]:
    """Role (``SWIGLU_ROLES``) -> the checkpoint tensor that holds it, for one expert of a
    per-expert layout as :func:`make_checkpoint` (and transformers' ``save_pretrained``)
    writes it: ``model.layers.{L}.block_sparse_moe.experts.{E}.w1/w3/w2.weight`` for Mixtral,
    ``model.layers.{L}.mlp.experts.{E}.{role}.weight`` for the others. ValueError for the
    architectures whose experts are stacked (gpt-oss)."""
    if arch not in ARCHS or arch == "gpt-oss":
        raise ValueError(f"{arch!r} has no per-expert tensors; per-expert architectures: "
                         f"{', '.join(a for a in ARCHS if a != 'gpt-oss')}")
    if arch == "mixtral":
        q = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return {role: f"{q}.{W_NAMES[role]}.weight" for role in SWIGLU_ROLES}
    q = f"model.layers.{layer}.mlp.experts.{expert}"
    return {role: f"{q}.{role}.weight" for role in SWIGLU_ROLES}


def _layer_tensors(spec: CheckpointSpec, layer: int, rng: np.random.Generator
                   ) -> Iterator[tuple[str, str, np.ndarray]]:
    h, i, e = spec.hidden, spec.intermediate, spec.experts
    p = f"model.layers.{layer}"
    yield f"{p}.input_layernorm.weight", *_weights(rng, (h,), "bf16")
    yield f"{p}.self_attn.o_proj.weight", *_weights(rng, (h, h), "bf16")
    if spec.arch == "deepseek-v3" and layer < spec.dense_layers:
        for name, shape in (("gate_proj", (4 * i, h)), ("up_proj", (4 * i, h)),
                            ("down_proj", (h, 4 * i))):
            yield f"{p}.mlp.{name}.weight", *_weights(rng, shape, "bf16")
        return
    if spec.arch == "gpt-oss":
        q = f"{p}.mlp.experts"
        yield f"{p}.mlp.router.weight", *_weights(rng, (e, h), "bf16")
        yield f"{q}.gate_up_proj", *_weights(rng, (e, h, 2 * i), spec.dtype)
        yield f"{q}.gate_up_proj_bias", *_weights(rng, (e, 2 * i), spec.dtype)
        yield f"{q}.down_proj", *_weights(rng, (e, i, h), spec.dtype)
        yield f"{q}.down_proj_bias", *_weights(rng, (e, h), spec.dtype)
        return
    if spec.fused:
        yield f"{p}.mlp.gate.weight", *_weights(rng, (e, h), "bf16")
        yield f"{p}.mlp.experts.gate_up_proj", *_weights(rng, (e, 2 * i, h), spec.dtype)
        yield f"{p}.mlp.experts.down_proj", *_weights(rng, (e, h, i), spec.dtype)
    else:
        block = "block_sparse_moe" if spec.arch == "mixtral" else "mlp"
        yield f"{p}.{block}.gate.weight", *_weights(rng, (e, h), "bf16")
        shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        for x in range(e):
            for role, name in expert_tensor_names(spec.arch, layer, x).items():
                yield name, *_weights(rng, shapes[role], spec.dtype)
                if spec.dtype == "fp8":
                    scale = (-(-shapes[role][0] // 128), -(-shapes[role][1] // 128))
                    yield (name.replace(".weight", ".weight_scale_inv"), "F32",
                           rng.uniform(0.5, 2.0, size=scale).astype(np.float32))
    if spec.arch == "qwen2-moe":
        for name, shape in (("gate_proj", (2 * i, h)), ("up_proj", (2 * i, h)),
                            ("down_proj", (h, 2 * i))):
            yield f"{p}.mlp.shared_expert.{name}.weight", *_weights(rng, shape, "bf16")
    if spec.arch == "deepseek-v3":
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield f"{p}.mlp.shared_experts.{name}.weight", *_weights(rng, shape, "bf16")


_SPEC_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F32": "float32"}


FILE_MODE, DIR_MODE = 0o644, 0o755
"""Modes of a written checkpoint's files and directory: readable by an agent that runs as its
own service user."""


def _save(path: Path, tensors: list[tuple[str, str, np.ndarray]]) -> None:
    specs = {name: safetensors.TensorSpec(dtype=_SPEC_DTYPES[dt], shape=list(arr.shape),
                                          data_ptr=arr.ctypes.data, data_len=arr.nbytes)
             for name, dt, arr in tensors}
    tmp = path.with_suffix(".tmp")
    safetensors.serialize_file(specs, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def make_checkpoint(directory: str | Path, spec: CheckpointSpec,
                    layers_per_shard: int = 2) -> Path:
    """Write the checkpoint; returns its directory. Deterministic for a given spec. Files are
    ``FILE_MODE`` in a ``DIR_MODE`` directory whatever the umask."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(DIR_MODE)
    cfg = _config(spec)
    rng = np.random.default_rng(spec.seed)
    nshards = -(-spec.layers // layers_per_shard)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(nshards):
        fname = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
        tensors = []
        if s == 0:
            tensors.append(("model.embed_tokens.weight",
                            *_weights(rng, (cfg["vocab_size"], spec.hidden), "bf16")))
        for layer in range(s * layers_per_shard, min(spec.layers, (s + 1) * layers_per_shard)):
            tensors.extend(_layer_tensors(spec, layer, rng))
        _save(root / fname, tensors)
        for name, _, arr in tensors:
            weight_map[name] = fname
            total += arr.nbytes
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for f in [root / "config.json", root / "model.safetensors.index.json",
              *(root / fname for fname in set(weight_map.values()))]:
        f.chmod(FILE_MODE)  # serialize_file creates 0600 and a umask may narrow the rest
    return root


def read_tensor_bytes(directory: str | Path) -> dict[str, bytes]:
    """Every tensor's bytes in a checkpoint directory, read by the safetensors library itself:
    an independent reference for verifying delivered experts."""
    out: dict[str, bytes] = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        for name, spec in safetensors.deserialize(shard.read_bytes()):
            out[name] = bytes(spec["data"])
    return out
