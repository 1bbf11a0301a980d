"""A slot pool larger than one grouped GEMM takes (``MAX_GROUPS`` slots): each layer computes
one forward per window of the pool that holds a routed expert, the others' experts renumbered
to an expert-parallel sentinel, and sums them; the logits and ``generate()`` output equal the
resident model's, in every experts implementation transformers has for CPU and GPU."""

from __future__ import annotations

from typing import Any

import pytest

from host_client import AgentClient, CpuReferenceDevice
from host_client.launcher import AgentProcess
from tests.test_transformers_checkpoints import COMMON, INTER

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from host_client.integrations.pool_views import MAX_GROUPS  # noqa: E402
from host_client.integrations.transformers import _Layer, offload_experts  # noqa: E402

EXPERTS_PER_LAYER, LAYERS = 520, 2
"""1,040 experts: a pool of every one is two windows of 520 slots."""


def _wide_model(dtype: Any) -> Any:
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": LAYERS,
                                         "num_experts_per_tok": 8, "moe_intermediate_size": INTER,
                                         "intermediate_size": 96,
                                         "num_experts": EXPERTS_PER_LAYER})
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def _windows_computed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first slot of each window a layer's forward computed, in order."""
    seen: list[int] = []
    forward = _Layer._forward

    def spy(self: _Layer, window: Any, *args: Any) -> Any:
        seen.append(window.first)
        return forward(self, window, *args)

    monkeypatch.setattr(_Layer, "_forward", spy)
    return seen


def _serve(model: Any, path: Any, device: Any, implementation: str, ids: Any,
           monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, list[int]]:
    """The resident model's logits and greedy tokens, then the offloaded model's, and the
    windows it computed."""
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        want = model(ids).logits, model.generate(ids, max_new_tokens=3, do_sample=False)
    slots = EXPERTS_PER_LAYER * LAYERS
    arena = f'[arena]\nbytes = "{slots * 3 * 64 * INTER * 4 + (32 << 20)}"\n'
    with AgentProcess(arena) as agent, AgentClient(agent.address) as client:
        offload = offload_experts(model, client, path, device, cache=1.0, layer_homes=False)
        layer = next(iter(offload.layers.values())).forward
        assert [w.count for w in layer.windows] == [EXPERTS_PER_LAYER] * 2
        seen = _windows_computed(monkeypatch)
        with torch.no_grad():
            got = model(ids).logits, model.generate(ids, max_new_tokens=3, do_sample=False)
        offload.settle()
    return want, got, seen


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_a_pool_of_more_slots_than_one_grouped_gemm_takes(tmp_path, implementation: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    assert EXPERTS_PER_LAYER * LAYERS > MAX_GROUPS
    model = _wide_model(torch.float32)
    model.save_pretrained(tmp_path / "wide")
    ids = torch.arange(96).reshape(1, 96) % COMMON["vocab_size"]
    (want, want_tokens), (got, got_tokens), seen = _serve(
        model, tmp_path / "wide", CpuReferenceDevice(), implementation, ids, monkeypatch)
    # Each window's sum is rounded before the two are added: float32, not bit-equal.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    assert set(seen) == {0, EXPERTS_PER_LAYER}, "the second window was never computed"


@pytest.mark.gpu
def test_on_a_gpu_a_pool_of_more_slots_than_one_grouped_gemm_takes(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 on the GPU with transformers' grouped_mm (CUTLASS on Hopper: 1,024 groups
    refused): the logits within bfloat16 rounding of the resident's (each window's sum is
    rounded to bfloat16 before the two add, one rounding more than the resident layer's; the
    greedy tokens, which one such rounding can flip on a random model, are the float32 CPU
    test's to compare)."""
    from host_client.cuda_device import CudaDevice

    model = _wide_model(torch.bfloat16)
    model.save_pretrained(tmp_path / "wide")
    model = model.to("cuda")
    ids = (torch.arange(96).reshape(1, 96) % COMMON["vocab_size"]).to("cuda")
    (want, _), (got, _), seen = _serve(
        model, tmp_path / "wide", CudaDevice(0), "grouped_mm", ids, monkeypatch)
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    assert set(seen) == {0, EXPERTS_PER_LAYER}


def test_windows_cover_the_pool_in_the_fewest_runs_of_at_most_the_limit() -> None:
    """Every slot in exactly one window, in order, each window at most ``limit`` slots and its
    views the pool's views' slots from its first, zero-copy; no fewer windows would do."""
    import math

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from host_client.integrations.pool_views import PoolViews

    @settings(deadline=None, max_examples=200)
    @given(st.integers(1, 5000), st.integers(8, 1100))
    def check(slots: int, limit: int) -> None:
        pool = torch.arange(slots * 2).reshape(slots, 2)
        windows = PoolViews({"w": pool}, slots, 16).windows(limit)
        assert len(windows) == math.ceil(slots / limit)
        assert [w.first for w in windows] == [sum(v.count for v in windows[:i])
                                              for i in range(len(windows))]
        assert sum(w.count for w in windows) == slots
        for w in windows:
            assert 1 <= w.count <= limit and w.tensors["w"].shape[0] == w.count
            assert w.tensors["w"].data_ptr() == pool[w.first].data_ptr()

    check()
