"""transformers models served through the agent (``offload_experts``): the experts' own
parameters dropped, each MoE layer's routed experts acquired from a slot pool smaller than the
model's experts, and the logits and ``generate()`` output equal to the untouched model's."""

from __future__ import annotations

import time

import pytest

from host_client import AgentClient, CpuReferenceDevice
from host_client.launcher import AgentProcess
from tests.test_transformers_checkpoints import EXPERTS, FAMILIES, _model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from host_client.integrations.transformers import (  # noqa: E402
    OffloadError,
    experts_modules,
    load_without_experts,
    offload_experts,
    scaled_input_blocks,
)

SERVED = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss",
          "llama4_text",
          "granitemoe", "phimoe"]


def offload_model_layers(path) -> list[int]:
    """The MoE layers of a saved tiny model (every layer but DeepSeek's dense first)."""
    import json

    cfg = json.loads((path / "config.json").read_text())
    first_dense = cfg.get("first_k_dense_replace", 0)
    step = cfg.get("interleave_moe_layer_step", 1)
    return [la for la in range(cfg["num_hidden_layers"])
            if la >= first_dense and (la + 1) % step == 0]


@pytest.mark.parametrize("form", ["default", "fused"])
@pytest.mark.parametrize("model_type", SERVED)
def test_logits_and_generate_equal_the_resident_model(tmp_path, agent: AgentProcess,
                                                      model_type: str, form: str) -> None:
    model = _model(model_type).eval()
    path = tmp_path / model_type
    model.save_pretrained(path, **({"save_original_format": False} if form == "fused" else {}))
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]])
    with torch.no_grad():
        want = model(ids).logits
        want_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    modules = [*experts_modules(model), *((n, b.experts) for n, b in scaled_input_blocks(model))]
    with AgentClient(agent.address) as client:
        offload = offload_experts(model, client, path, CpuReferenceDevice(), cache=EXPERTS,
                                  name=f"off-{model_type}-{form}")
        assert len(modules) == len(offload.layers) == len(offload_model_layers(path))
        assert not any(p in m._parameters for _, m in modules
                       for p in ("gate_up_proj", "down_proj")), "expert weights stayed"
        with torch.no_grad():
            got = model(ids).logits
            got_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want), (got - want).abs().max()
        assert torch.equal(got_tokens, want_tokens)
        assert offload.forwards >= 2 * len(offload.layers)
        # More deliveries than slots: the pool (one layer's experts) was reused across layers.
        assert offload.experts_acquired - offload.hits > EXPERTS


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss",
                                        "llama4_text"])
def test_a_model_loaded_without_its_experts_is_served(tmp_path, agent: AgentProcess,
                                                      model_type: str) -> None:
    """``load_without_experts``: transformers loads everything but the routed experts (renamed
    from the checkpoint's original form where the family needs it: Mixtral's
    ``block_sparse_moe``), whose parameters never exist; with them served by the agent the
    logits equal the whole model's, loaded alike."""
    path = tmp_path / model_type
    _model(model_type).save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]])
    with torch.no_grad():
        want = model(ids).logits
    ignored = type(model).__dict__.get("_keys_to_ignore_on_load_unexpected")
    loaded = load_without_experts(path, dtype=torch.bfloat16).eval()
    full, got = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert set(got) == {n for n in full if ".experts." not in n}
    assert all(torch.equal(p, full[n]) for n, p in got.items())
    # Nothing stays patched: the same classes built afterwards have their experts again.
    assert dict(_model(model_type).named_parameters()).keys() == full.keys()
    assert type(loaded).__dict__.get("_keys_to_ignore_on_load_unexpected") == ignored
    with AgentClient(agent.address) as client:
        offload_experts(loaded, client, path, CpuReferenceDevice(), cache=EXPERTS,
                        name=f"meta-{model_type}")
        with torch.no_grad():
            served = loaded(ids).logits
    assert torch.equal(served, want), (served - want).abs().max()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama4_text"])
def test_generate_reports_its_routing_to_the_agent(tmp_path, agent: AgentProcess,
                                                   model_type: str) -> None:
    """``report_routing`` (the default): each forward's routing (every MoE layer's experts and
    their tokens) reaches the agent's routing statistics through the device's channel with no
    gRPC call, one visit per layer and forward (the agent's own counter), and the tokens are
    unchanged."""
    from bench.common import scrape

    model = _model(model_type).eval()
    path = tmp_path / model_type
    model.save_pretrained(path)
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    name = f"rr-{model_type}"
    with AgentClient(agent.address) as client:
        offload = offload_experts(model, client, path, CpuReferenceDevice(), cache=EXPERTS,
                                  name=name)
        before = scrape(agent).get(f"dpu_agent_routing_visits_total/{name}", 0.0)
        calls = client.rpc_calls["ReportRouting"]
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=4, do_sample=False)
        visits = len(forwards) * len(offload.layers)
        assert offload.visits_reported == visits and client.visits_refused == 0
        assert client.rpc_calls["ReportRouting"] == calls
        deadline = time.monotonic() + 10
        while scrape(agent)[f"dpu_agent_routing_visits_total/{name}"] - before < visits:
            assert time.monotonic() < deadline, "the agent did not fold every visit"
            time.sleep(0.01)
        assert scrape(agent)[f"dpu_agent_routing_visits_total/{name}"] - before == visits
    assert torch.equal(got, want)


def test_report_routing_off_reports_nothing(tmp_path, agent: AgentProcess) -> None:
    """``report_routing=False``: no visit is posted, the agent folds none, tokens unchanged."""
    from bench.common import scrape

    model = _model("qwen3_moe").eval()
    model.save_pretrained(tmp_path / "m")
    ids = torch.tensor([[3, 17, 42, 5]])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
    with AgentClient(agent.address) as client:
        offload = offload_experts(model, client, tmp_path / "m", CpuReferenceDevice(),
                                  cache=EXPERTS, name="rr-off", report_routing=False)
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert offload.visits_reported == 0
        assert scrape(agent).get("dpu_agent_routing_visits_total/rr-off", 0.0) == 0.0
    assert torch.equal(got, want)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3",
                                        "olmoe"])
def test_pre_gated_prefetch_changes_nothing_but_the_hits(tmp_path, agent: AgentProcess,
                                                         model_type: str) -> None:
    """``prefetch=True``: each layer applies the next layer's router to its own input and
    prefetches what it would choose. ``generate()`` gives the same tokens; more acquires find
    their expert resident or on its way than without; most predictions were used."""
    model = _model(model_type).eval()
    path = tmp_path / model_type
    model.save_pretrained(path)
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    hits = {}
    for prefetch in (False, True):
        model = _model(model_type).eval()
        with AgentClient(agent.address) as client:
            offload = offload_experts(model, client, path, CpuReferenceDevice(), cache=EXPERTS,
                                      name=f"pf-{model_type}-{prefetch}", prefetch=prefetch)
            with torch.no_grad():
                got = model.generate(ids, max_new_tokens=6, do_sample=False)
            assert torch.equal(got, want)
            hits[prefetch] = offload.hits
            if prefetch:
                assert offload.prefetched >= offload.prefetch_used > offload.prefetched // 2
                assert client.prefetches_refused == 0
            else:
                assert offload.prefetched == offload.prefetch_used == 0
    assert hits[True] > hits[False], hits


def test_the_dma_engine_can_fill_the_experts(tmp_path, agent: AgentProcess) -> None:
    """``delivery="engine"``: the agent's DMA-engine process fills the pool, this process
    checks each landed slot (the NumPy twin here); logits equal the resident model's."""
    model = _model("qwen3_moe").eval()
    path = tmp_path / "qwen3"
    model.save_pretrained(path)
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]])
    with torch.no_grad():
        want = model(ids).logits
    with AgentClient(agent.address) as client:
        offload = offload_experts(model, client, path, CpuReferenceDevice(), cache=EXPERTS,
                                  name="off-engine", delivery="engine")
        assert offload.device.work is None  # no consumer of this process's own
        with torch.no_grad():
            got = model(ids).logits
    assert torch.equal(got, want), (got - want).abs().max()


def test_a_model_that_does_not_fit_the_checkpoint_is_refused(tmp_path,
                                                             agent: AgentProcess) -> None:
    path = tmp_path / "qwen"
    _model("qwen3_moe").save_pretrained(path)
    other = _model("mixtral")  # its own expert count, layers, names
    other.model.layers[1].mlp.experts.num_experts = EXPERTS + 1
    with AgentClient(agent.address) as client, pytest.raises(OffloadError,
                                                             match="5 experts, the checkpoint"):
        offload_experts(other, client, path, CpuReferenceDevice(), name="misfit")
    assert FAMILIES  # the families the checkpoint tests build


@pytest.mark.parametrize("cache", [0, -3, 0.0, 1.5, float("nan"), True, "25%"])
def test_a_cache_size_it_cannot_use_is_refused_before_anything_is_loaded(
        tmp_path, agent: AgentProcess, cache: object) -> None:
    path = tmp_path / "qwen"
    model = _model("qwen3_moe")
    model.save_pretrained(path)
    name = f"refused-{tmp_path.name}"  # the agent is the module's: a name of this test's own
    with AgentClient(agent.address) as client:
        with pytest.raises(ValueError, match="cache: a fraction in"):
            offload_experts(model, client, path, CpuReferenceDevice(), cache=cache, name=name)
        assert name not in [m.model for m in client.status().models]
        offload_experts(model, client, path, CpuReferenceDevice(), cache=0.5, name=name)
        assert name in [m.model for m in client.status().models]  # what was not there


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_waits", [False, True])
@pytest.mark.parametrize(("model_type", "delivery"), [("qwen3_moe", "pull"),
                                                      ("qwen3_moe", "engine"),
                                                      ("llama4_text", "engine")])
def test_on_a_gpu_logits_equal_the_resident_model(tmp_path, agent: AgentProcess,
                                                  model_type: str, delivery: str,
                                                  gpu_waits: bool) -> None:
    """The model on the GPU, the experts delivered into a CUDA slot pool (by the device's
    consumer, or by the DMA engine and checked on the GPU), viewed by torch through DLPack;
    the host waiting for the experts, or (``gpu_waits``) the stream. A second forward finds
    every expert in its slot (the pool holds them all): each layer's experts stay held until
    the next layer's acquire (the last layer's until ``settle``), and then nothing is held at
    the agent."""
    from host_client import SlotPoolSpec
    from host_client.cuda_device import CudaDevice

    model = _model(model_type).eval()
    path = tmp_path / model_type
    model.save_pretrained(path)
    model = model.to("cuda")
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]], device="cuda")
    with torch.no_grad():
        want = model(ids).logits
    with AgentClient(agent.address) as client:
        name = f"gpu-{model_type}-{delivery}-{gpu_waits}"
        info = client.load_model(str(path), name)
        # A slot for every expert: the second forward finds each in its slot.
        slots = EXPERTS * len(info.moe_layers)
        dev = client.register_device(CudaDevice(0), [SlotPoolSpec(info.expert_bytes, slots)],
                                     delivery=delivery)
        offload = offload_experts(model, client, path, dev, name=name, gpu_waits=gpu_waits)
        with torch.no_grad():
            got = model(ids).logits
            again = model(ids).logits
        assert torch.equal(got, want), (got - want).abs().max()
        assert torch.equal(again, want), (again - want).abs().max()
        assert offload.stream_retries == 0
        assert len(offload.held) == 1 and offload.held[0][1]  # the last layer's experts
        offload.settle()
        assert not offload.held
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # a release is posted, not waited for
            session = next(s for s in client.status().sessions
                           if s.session_id == client.session_id)
            if session.slots_held == 0:
                break
            time.sleep(0.01)
        assert session.slots_held == 0


@pytest.mark.gpu
def test_on_a_gpu_a_layer_whose_delivery_fails_its_check_is_computed_again(tmp_path) -> None:
    """``gpu_waits``: a layer's kernels are enqueued behind stream waits on the experts' bytes.
    The arena corrupted under the agent: the check on the stream fails, the layer is acquired
    again (the agent refetches from the checkpoint) with the host waiting, and computed
    again: the logits still equal the resident model's."""
    from bench.common import scrape
    from dpu_offload.shm import SharedBuffer
    from host_client.cuda_device import CudaDevice

    model = _model("qwen3_moe").eval()
    path = tmp_path / "qwen3"
    model.save_pretrained(path)
    model = model.to("cuda")
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]], device="cuda")
    with torch.no_grad():
        want = model(ids).logits
    with AgentProcess('[arena]\nbytes = "64MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n'
                      ) as agent, AgentClient(agent.address) as client:
        offload = offload_experts(model, client, path, CudaDevice(0), cache=EXPERTS,
                                  delivery="engine", name="retried", gpu_waits=True)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)
        assert offload.stream_retries == 0
        arena = SharedBuffer(client.arena.shm_name, client.arena.size_bytes)
        arena.array[:int(scrape(agent)["dpu_agent_arena_used_bytes"])] ^= 0x01
        arena.close()
        with torch.no_grad():
            got = model(ids).logits
        assert offload.stream_retries >= 1
        assert scrape(agent)["dpu_agent_checksum_failures_total"] >= 1
    assert torch.equal(got, want), (got - want).abs().max()


def test_loading_a_model_without_experts_modules_is_refused(tmp_path) -> None:
    """A dense checkpoint has no experts to leave out: OffloadError naming it, nothing
    patched."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "dense")
    with pytest.raises(OffloadError, match="no experts module to leave out"):
        load_without_experts(tmp_path / "dense")


def test_the_slot_numbers_go_to_the_device_only_when_a_routed_expert_moved() -> None:
    """A layer keeps each window's slot numbers on the experts' device: the same routed
    experts in the same slots reuse that row (no copy), a change in an entry the kernels do
    not read (an expert not routed) too; a routed expert in another slot gets a new row."""
    import numpy as np
    import torch

    from host_client.integrations.pool_views import Window
    from host_client.integrations.transformers import _Layer

    layer = object.__new__(_Layer)
    layer._slots = {}
    cpu, window = torch.device("cpu"), Window(0, 9, {})

    def row(**slots: int) -> np.ndarray:
        r = np.full(5, 9, np.int64)
        for e, s in slots.items():
            r[int(e[1:])] = s
        return r

    first = layer._slots_on(window, cpu, row(e0=3, e2=5), [0, 2])
    assert first.tolist() == [3, 9, 5, 9, 9]
    assert layer._slots_on(window, cpu, row(e0=3, e2=5), [0, 2]) is first
    assert layer._slots_on(window, cpu, row(e0=3, e1=7), [0]) is first  # entry 1 is not read
    moved = layer._slots_on(window, cpu, row(e0=4, e2=5), [0, 2])
    assert moved is not first and moved.tolist() == [4, 9, 5, 9, 9]
