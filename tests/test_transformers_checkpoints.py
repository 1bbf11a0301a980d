"""Checkpoints as Hugging Face transformers writes them: tiny random models of every MoE family
built from transformers' own config classes and written with ``save_pretrained`` (default,
sharded, and the fused form ``save_original_format=False``). Each is recognised from its
tensor names (the right MoE layers, experts and shared experts), and every expert the agent
delivers equals, byte for byte, the model's own parameter (or its slice)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpu_agent.weights.catalog import build_catalog
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN, INTER, EXPERTS, LAYERS = 64, 24, 4, 3
COMMON = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, head_dim=16)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=8,
           v_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1,
           moe_intermediate_size=INTER, intermediate_size=96, n_routed_experts=EXPERTS,
           n_shared_experts=1, num_key_value_heads=4)
FAMILIES: dict[str, tuple[str, dict[str, Any], int]] = {
    # model_type: (config class, its arguments, shared experts per MoE layer)
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=INTER, intermediate_size=96,
                                         num_experts=EXPERTS), 0),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=INTER, intermediate_size=96,
                                         num_experts=EXPERTS,
                                         shared_expert_intermediate_size=48), 1),
    "mixtral": ("MixtralConfig", dict(intermediate_size=INTER, num_local_experts=EXPERTS), 0),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=INTER, num_experts=EXPERTS), 0),
    "deepseek_v2": ("DeepseekV2Config", MLA, 1),
    "deepseek_v3": ("DeepseekV3Config", MLA, 1),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=INTER, num_local_experts=EXPERTS), 0),
    "llama4_text": ("Llama4TextConfig", dict(intermediate_size=INTER, intermediate_size_mlp=96,
                                             num_local_experts=EXPERTS), 1),
    "granitemoe": ("GraniteMoeConfig", dict(intermediate_size=INTER,
                                            num_local_experts=EXPERTS), 0),
    "phimoe": ("PhimoeConfig", dict(intermediate_size=INTER, num_local_experts=EXPERTS), 0),
}
FORMS = {"default": {}, "sharded": {"max_shard_size": "40KB"},
         "fused": {"save_original_format": False}}


def _model(model_type: str) -> Any:
    cls_name, kwargs, _ = FAMILIES[model_type]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(**{**COMMON, "num_experts_per_tok": 2, **kwargs})
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


_EXPERT_PARAM = re.compile(r"layers\.(\d+)\.\w+\.experts\.(\w+)$")


def _experts_in_memory(model: Any) -> dict[int, dict[str, Any]]:
    """layer -> {parameter name after ``experts.``: tensor [E, ...]} of the live model."""
    out: dict[int, dict[str, Any]] = {}
    for name, value in model.state_dict().items():
        m = _EXPERT_PARAM.search(name)
        if m:
            out.setdefault(int(m[1]), {})[m[2]] = value
    return out


def _truth(params: dict[str, Any], role: str, expert: int) -> bytes:
    """The bytes a blob role must hold: the expert's slice of the live parameter (gate and up
    are the two row halves of a fused ``[2I, H]`` gate_up_proj)."""
    if role in ("gate_proj", "up_proj"):
        fused = params["gate_up_proj"][expert]
        assert fused.shape[0] == 2 * INTER, "gate/up halves are rows of an [2I, H] weight"
        part = fused[:INTER] if role == "gate_proj" else fused[INTER:]
    else:
        part = params[role][expert]
    return part.contiguous().view(torch.uint16 if part.dtype == torch.bfloat16
                                  else torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for model_type in FAMILIES:
        model = _model(model_type)
        for form, kwargs in FORMS.items():
            path = root / f"{model_type}-{form}"
            model.save_pretrained(path, **kwargs)
            out[(model_type, form)] = (path, model)
    return out


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_recognised_with_its_layers_experts_and_bytes(saved, model_type: str, form: str) -> None:
    path, model = saved[(model_type, form)]
    live = _experts_in_memory(model)
    cat = build_catalog(path, "m")
    layout = cat.layout
    assert layout.architecture == model_type
    assert layout.moe_layers == tuple(sorted(live)), layout.pattern
    assert layout.experts_per_layer == EXPERTS
    assert layout.shared_experts_per_layer == FAMILIES[model_type][2]
    assert (layout.hidden_size, layout.intermediate_size) == (HIDDEN, INTER)
    for key, entry in cat.experts.items():
        for t in entry.tensors:
            assert t.file is not None
            with t.file.open("rb") as f:
                f.seek(t.file_offset)
                got = f.read(t.nbytes)
            assert got == _truth(live[key.layer], t.role, key.expert), (key, t.role)


@pytest.mark.parametrize("form", ["default", "fused"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss",
                                        "llama4_text"])
def test_every_delivered_expert_is_the_models_own(saved, agent: AgentProcess,
                                                  model_type: str, form: str) -> None:
    path, model = saved[(model_type, form)]
    live = _experts_in_memory(model)
    name = f"hf-{model_type}-{form}"
    with AgentClient(agent.address) as client:
        info = client.load_model(str(path), name)
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(
            info.expert_bytes, len(info.moe_layers) * info.experts_per_layer)])
        keys = [ExpertKey(name, layer, e) for layer in info.moe_layers
                for e in range(info.experts_per_layer)]
        for h in client.acquire_batch(dev, keys):
            slot = h.wait(30)
            for role in slot.names:
                raw = np.ascontiguousarray(slot.raw(role)).tobytes()
                assert raw == _truth(live[slot.key.layer], role, slot.key.expert), \
                    (slot.key, role)
            # torch views on the CPU reference device; the fused gate|up view whichever way
            # the checkpoint stored it.
            fused = live[slot.key.layer]["gate_up_proj"][slot.key.expert]
            assert torch.equal(slot.torch("gate_up_proj"), fused), slot.key
