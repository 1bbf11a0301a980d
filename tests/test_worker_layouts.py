"""Every expert layout the activation worker computes: per-expert, fused and in-out SwiGLU
tensors, the resident kernel's model table, gpt-oss's clamped SwiGLU in BF16 and MXFP4 (against
transformers' own ``GptOssExperts``), each served end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dpu_offload.keys import ExpertKey
from gpu_kernels import reference
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationSender
from host_client.launcher import AgentProcess
from host_client.memory import ExpertSlot
from host_client.worker import ExpertWorker
from tests.activation_serving import SETTINGS, dispatch_matches_dense, routing, serving
from tests.conftest import checkpoint_bytes


def _slot(tensors: dict[str, tuple[np.ndarray, str]]) -> ExpertSlot:
    """An expert slot over a blob holding ``tensors`` (name -> (array, safetensors dtype)),
    each 256-byte aligned as the agent lays them out."""
    from dpu_offload.v1 import agent_pb2 as pb

    entries, parts, offset = [], [], 0
    for name, (array, dtype) in tensors.items():
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        entries.append(pb.TensorEntry(name=name, dtype=dtype, shape=list(array.shape),
                                      offset=offset, nbytes=raw.size))
        pad = -raw.size % 256
        parts += [raw, np.zeros(pad, np.uint8)]
        offset += raw.size + pad
    manifest = pb.ExpertManifest(key=pb.ExpertKey(model="m", layer=0, expert=0),
                                 blob_bytes=offset, tensors=entries)
    return ExpertSlot(ExpertKey("m", 0, 0), np.concatenate(parts), manifest)


def test_swiglu_weights_of_every_layout_the_worker_computes() -> None:
    """Per-expert tensors, transformers 5's fused ``[2I, H]`` / ``[H, I]`` and Llama-4's
    ``[H, 2I]`` / ``[I, H]`` give the same gate ``[I, H]``, up ``[I, H]`` and down ``[H, I]``;
    biases (gpt-oss's activation) and FP8 are refused by name."""
    rng = np.random.default_rng(3)
    hidden, inter = 16, 8
    gate, up, down = (rng.integers(0, 1 << 15, shape).astype(np.uint16)
                      for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
    layouts = {
        "per-expert": {"gate_proj": (gate, "BF16"), "up_proj": (up, "BF16"),
                       "down_proj": (down, "BF16")},
        "fused": {"gate_up_proj": (np.concatenate([gate, up]), "BF16"),
                  "down_proj": (down, "BF16")},
        "in_out": {"gate_up_proj": (np.concatenate([gate.T, up.T], axis=1), "BF16"),
                   "down_proj": (down.T, "BF16")},
    }
    for name, tensors in layouts.items():
        got = _slot(tensors).swiglu_weights()
        for g, want in zip(got, (gate, up, down), strict=True):
            assert np.array_equal(g, want), name
    with pytest.raises(ValueError, match="gate_up_proj_bias"):
        _slot({**layouts["in_out"], "gate_up_proj_bias": (np.zeros(2 * inter, np.uint16),
                                                          "BF16")}).swiglu_weights()
    with pytest.raises(ValueError, match="F8_E4M3"):
        _slot({"gate_proj": (gate.view(np.uint8), "F8_E4M3"),
               "up_proj": (up.view(np.uint8), "F8_E4M3"),
               "down_proj": (down.view(np.uint8), "F8_E4M3")}).swiglu_weights()


def _table_weights(slot: ExpertSlot, entry: np.void) -> list[np.ndarray]:
    """gate, up [I, H] and down [H, I] as the resident kernel addresses them from its model
    table entry (element strides from byte offsets in the slot's blob)."""
    words = slot.blob.view(np.uint16)
    i, h = int(entry["inter"]), int(entry["hidden"])
    j, k = np.meshgrid(np.arange(i), np.arange(h), indexing="ij")
    gate_up = [words[int(entry[name]) // 2 + j * int(entry["g_sj"]) + k * int(entry["g_sk"])]
               for name in ("gate", "up")]
    if int(entry["kind"]) == 1:  # row-major: the kernel's 16-byte loads
        gate_up = [words[int(entry[n]) // 2:][:i * h].reshape(i, h) for n in ("gate", "up")]
    a, b = np.meshgrid(np.arange(h), np.arange(i), indexing="ij")
    down = words[int(entry["down"]) // 2 + a * int(entry["d_si"]) + b * int(entry["d_sj"])]
    return [*gate_up, down]


def test_the_resident_kernel_reads_every_layout_as_the_twin_does() -> None:
    """The resident receiver's model table (host_client/serve_tables.py) addresses per-expert,
    fused ``[2I, H]``, Llama-4 ``[H, 2I]`` and gpt-oss's interleaved BF16 weights (with its
    biases, alpha and limit) exactly as the twin's views read them; MXFP4 and FP8 are left to
    the host-thread path (kind 0)."""
    from dpu_offload.v1 import agent_pb2 as pb
    from host_client.serve_tables import CLAMPED, CONTIGUOUS, STRIDED, model_entry

    rng = np.random.default_rng(8)
    hidden, inter = 16, 8
    gate, up, down = (rng.integers(0, 1 << 15, shape).astype(np.uint16)
                      for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
    swiglu = {
        CONTIGUOUS: [{"gate_proj": (gate, "BF16"), "up_proj": (up, "BF16"),
                      "down_proj": (down, "BF16")},
                     {"gate_up_proj": (np.concatenate([gate, up]), "BF16"),
                      "down_proj": (down, "BF16")}],
        STRIDED: [{"gate_up_proj": (np.concatenate([gate.T, up.T], axis=1), "BF16"),
                   "down_proj": (down.T, "BF16")}],
    }
    for kind, forms in swiglu.items():
        for tensors in forms:
            slot = _slot(tensors)
            entry = model_entry(slot.manifest)
            assert int(entry["kind"]) == kind
            for got, want in zip(_table_weights(slot, entry), slot.swiglu_weights(),
                                 strict=True):
                np.testing.assert_array_equal(got, want)
    fused = np.empty((hidden, 2 * inter), np.uint16)
    fused[:, 0::2], fused[:, 1::2] = gate.T, up.T
    bias = rng.integers(0, 1 << 15, 2 * inter).astype(np.uint16)
    down_bias = rng.integers(0, 1 << 15, hidden).astype(np.uint16)
    slot = _slot({"gate_up_proj": (fused, "BF16"), "gate_up_proj_bias": (bias, "BF16"),
                  "down_proj": (down.T, "BF16"), "down_proj_bias": (down_bias, "BF16")})
    slot.manifest.activation = pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU
    slot.manifest.swiglu_alpha, slot.manifest.swiglu_limit = 1.702, 7.0
    entry = model_entry(slot.manifest)
    assert int(entry["kind"]) == CLAMPED
    assert abs(float(entry["alpha"]) - 1.702) < 1e-6 and float(entry["limit"]) == 7.0
    w = slot.clamped_swiglu_weights()
    for got, want in zip(_table_weights(slot, entry), (w.gate, w.up, w.down), strict=True):
        np.testing.assert_array_equal(reference.bf16_to_f32(got), want)
    words = slot.blob.view(np.uint16)
    for name, want in (("gate_bias", w.gate_bias), ("up_bias", w.up_bias)):
        got = words[int(entry[name]) // 2 + np.arange(inter) * int(entry["b_s"])]
        np.testing.assert_array_equal(reference.bf16_to_f32(got), want)
    got = words[int(entry["down_bias"]) // 2:][:hidden]
    np.testing.assert_array_equal(reference.bf16_to_f32(got), w.down_bias)
    fp8 = _slot({"gate_proj": (gate.view(np.uint8), "F8_E4M3"),
                 "up_proj": (up.view(np.uint8), "F8_E4M3"),
                 "down_proj": (down.view(np.uint8), "F8_E4M3")})
    assert int(model_entry(fp8.manifest)["kind"]) == 0


def test_a_fused_checkpoint_is_served(tmp_path: Path) -> None:
    """A checkpoint saved fused (``experts.gate_up_proj`` ``[E, 2I, H]``): the worker splits
    each expert's halves and the combined output matches the dense reference."""
    from host_client.checkpoints import CheckpointSpec, make_checkpoint

    fused = make_checkpoint(tmp_path / "fused", CheckpointSpec(
        "qwen3-moe", layers=3, experts=6, hidden=256, intermediate=192, fused=True))
    with serving(fused) as (agent, _, model, _, _):
        layer = model.moe_layers[0]
        dispatch_matches_dense(f"127.0.0.1:{agent.activations_port}", "qa",
                               model.experts_per_layer, layer, fused,
                               routing(model.experts_per_layer, 8, 2, 5))


def _mxfp4_gpt_oss(root: Path, experts: int, hidden: int, inter: int) -> Path:
    """A one-layer gpt-oss checkpoint as released: MXFP4 expert weights (``_blocks`` /
    ``_scales``) with BF16 biases, stacked ``[E, ...]``."""
    import safetensors

    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "num_hidden_layers": 1, "num_local_experts": experts,
        "hidden_size": hidden, "intermediate_size": inter, "num_experts_per_tok": 2,
        "quantization_config": {"quant_method": "mxfp4"}}))
    rng = np.random.default_rng(2)
    p = "model.layers.0.mlp.experts"

    def bf16(*shape: int) -> np.ndarray:
        return reference.f32_to_bf16(rng.standard_normal(shape, dtype=np.float32))

    arrays = {
        f"{p}.gate_up_proj_blocks": rng.integers(0, 256, (experts, 2 * inter, hidden // 32, 16),
                                                 np.uint8),
        f"{p}.gate_up_proj_scales": rng.integers(118, 124, (experts, 2 * inter, hidden // 32),
                                                 np.uint8),
        f"{p}.gate_up_proj_bias": bf16(experts, 2 * inter),
        f"{p}.down_proj_blocks": rng.integers(0, 256, (experts, hidden, inter // 32, 16),
                                              np.uint8),
        f"{p}.down_proj_scales": rng.integers(118, 124, (experts, hidden, inter // 32),
                                              np.uint8),
        f"{p}.down_proj_bias": bf16(experts, hidden),
        "model.layers.0.mlp.router.weight": bf16(experts, hidden)}
    safetensors.serialize_file({
        n: safetensors.TensorSpec(dtype="uint8" if a.dtype == np.uint8 else "bfloat16",
                                  shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
        for n, a in arrays.items()}, str(root / "model.safetensors"))
    return root


def _gpt_oss_matches_transformers(tmp_path: Path, device: object, form: str = "bf16",
                                  resident: bool = False) -> None:
    """Serve a gpt-oss checkpoint (``form`` ``bf16``, as transformers saves it, with
    ``swiglu_limit`` 1.5, not the default: the agent must pass the config's on; or ``mxfp4``,
    as gpt-oss ships) from ``device`` and check the manifest's activation and the combined
    output against transformers' own ``GptOssExperts`` on the checkpoint's weights
    (dequantised by transformers' ``convert_moe_packed_tensors``)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from dpu_offload.v1 import agent_pb2 as pb
    from host_client.checkpoints import CheckpointSpec, make_checkpoint

    limit = 1.5 if form == "bf16" else 7.0
    if form == "bf16":
        ckpt = make_checkpoint(tmp_path / "gpt-oss", CheckpointSpec(
            "gpt-oss", layers=2, experts=6, hidden=256, intermediate=192))
        cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": limit}))
    else:
        ckpt = _mxfp4_gpt_oss(tmp_path / "gpt-oss-mxfp4", 6, 256, 192)
    ids = routing(6, 8, 2, 11)
    rng = np.random.default_rng(4)
    x = reference.f32_to_bf16(rng.standard_normal((ids.shape[0], 256), dtype=np.float32))
    w = rng.random(ids.shape, dtype=np.float32)
    w /= w.sum(1, keepdims=True)
    with AgentProcess(SETTINGS + "worker_timeout_seconds = 60\n") as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(ckpt), "qa")
        dev = client.register_device(device, [SlotPoolSpec(model.expert_bytes, 12)])
        client.wait_placement(client.apply_placement("qa", [
            [[dev.device_id]] * model.experts_per_layer for _ in model.moe_layers]).placement_id)
        layer = model.moe_layers[-1]
        manifest = client.manifest(ExpertKey("qa", layer, 0))
        assert manifest.activation == pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU
        assert manifest.swiglu_limit == limit and abs(manifest.swiglu_alpha - 1.702) < 1e-6
        worker = ExpertWorker(client, dev)
        try:
            with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qa", 6,
                                  credits=4) as sender:
                got = reference.bf16_to_f32(sender.dispatch(layer, x, ids, w))
            assert (worker.resident is not None) == resident  # who computed it
        finally:
            worker.close()
    truth = checkpoint_bytes(ckpt)
    experts = GptOssExperts(GptOssConfig(hidden_size=256, intermediate_size=192,
                                         num_local_experts=6, swiglu_limit=limit))
    p = f"model.layers.{layer}.mlp.experts"

    def raw(name: str, dtype: type, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(truth[f"{p}.{name}"], dtype).reshape(shape).copy())

    for name, shape in (("gate_up_proj_bias", (6, 384)), ("down_proj_bias", (6, 256))):
        getattr(experts, name).data = torch.from_numpy(
            reference.bf16_to_f32(raw(name, np.uint16, shape).numpy()))
    for name, (rows, cols) in (("gate_up_proj", (384, 256)), ("down_proj", (256, 192))):
        if form == "bf16":
            value = torch.from_numpy(reference.bf16_to_f32(
                raw(name, np.uint16, (6, cols, rows)).numpy()))
        else:
            value = convert_moe_packed_tensors(
                raw(f"{name}_blocks", np.uint8, (6, rows, cols // 32, 16)),
                raw(f"{name}_scales", np.uint8, (6, rows, cols // 32)), dtype=torch.float32)
        getattr(experts, name).data = value
    with torch.no_grad():
        want = experts(torch.from_numpy(reference.bf16_to_f32(x)), torch.from_numpy(ids),
                       torch.from_numpy(w)).numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_a_gpt_oss_checkpoint_is_served_as_transformers_computes_it(tmp_path: Path) -> None:
    """gpt-oss's experts (``gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved,
    biases, the clamped activation with the config's ``swiglu_limit``) on the CPU reference
    device: equal to transformers' ``GptOssExperts`` within bf16 rounding."""
    _gpt_oss_matches_transformers(tmp_path, CpuReferenceDevice())


def test_gpt_oss_as_released_in_mxfp4_is_served_as_transformers_computes_it(
        tmp_path: Path) -> None:
    """gpt-oss as published (MXFP4 ``_blocks`` / ``_scales``, BF16 biases): the worker
    dequantises each held expert once and matches transformers' ``GptOssExperts`` on the
    weights transformers dequantises."""
    _gpt_oss_matches_transformers(tmp_path, CpuReferenceDevice(), "mxfp4")


@pytest.mark.gpu
def test_a_gpt_oss_checkpoint_is_served_on_the_gpu(tmp_path: Path) -> None:
    """The same on a CUDA worker: BF16 by the resident receiver (its strided, biased, clamped
    FFN), MXFP4 by the worker's thread (packet kernels, the clamped FFN in CuPy)."""
    pytest.importorskip("cupy")
    from host_client.cuda_device import CudaDevice

    _gpt_oss_matches_transformers(tmp_path, CudaDevice(0, mechanism="copy_engine"),
                                  resident=True)
    _gpt_oss_matches_transformers(tmp_path, CudaDevice(0, mechanism="copy_engine"), "mxfp4")


def test_clamped_swiglu_weights_are_gpt_oss_halves_and_refuse_anything_else() -> None:
    """gpt-oss's ``gate_up_proj`` ``[H, 2I]`` interleaves gate (even columns) and up (odd),
    and so does its bias; MXFP4 blocks ``[2I, H/32, 16]`` interleave their rows likewise and
    dequantise as transformers does (``convert_moe_packed_tensors``); a blob with neither
    form (half of MXFP4, a plain SwiGLU expert) is refused by name."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from dpu_offload.v1 import agent_pb2 as pb

    rng = np.random.default_rng(5)
    hidden, inter = 64, 32

    def bf16(*shape: int) -> np.ndarray:
        return reference.f32_to_bf16(rng.standard_normal(shape, dtype=np.float32))

    fused, bias, down, down_bias = bf16(hidden, 2 * inter), bf16(2 * inter), bf16(inter, hidden), \
        bf16(hidden)
    biases = {"gate_up_proj_bias": (bias, "BF16"), "down_proj_bias": (down_bias, "BF16")}

    def clamped(tensors: dict[str, tuple[np.ndarray, str]]) -> ExpertSlot:
        slot = _slot(tensors)
        slot.manifest.activation = pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU
        slot.manifest.swiglu_alpha, slot.manifest.swiglu_limit = 1.5, 3.0
        return slot

    w = clamped({"gate_up_proj": (fused, "BF16"), "down_proj": (down, "BF16"), **biases}
                ).clamped_swiglu_weights()
    f32 = reference.bf16_to_f32
    for got, want in ((w.gate, f32(fused)[:, 0::2].T), (w.up, f32(fused)[:, 1::2].T),
                      (w.down, f32(down).T), (w.gate_bias, f32(bias)[0::2]),
                      (w.up_bias, f32(bias)[1::2]), (w.down_bias, f32(down_bias))):
        assert np.array_equal(got, want)
    assert (w.alpha, w.limit) == (1.5, 3.0)

    blocks = {"gate_up_proj": rng.integers(0, 256, (2 * inter, hidden // 32, 16), np.uint8),
              "down_proj": rng.integers(0, 256, (hidden, inter // 32, 16), np.uint8)}
    scales = {n: rng.integers(120, 134, b.shape[:-1], np.uint8) for n, b in blocks.items()}
    mx = clamped({**{f"{n}_blocks": (b, "U8") for n, b in blocks.items()},
                  **{f"{n}_scales": (s, "U8") for n, s in scales.items()}, **biases}
                 ).clamped_swiglu_weights()
    theirs = {n: convert_moe_packed_tensors(torch.from_numpy(blocks[n][None]),
                                            torch.from_numpy(scales[n][None]),
                                            dtype=torch.float32)[0].numpy()
              for n in blocks}  # [H, 2I] and [I, H], as GptOssExperts keeps them
    assert np.array_equal(mx.gate, theirs["gate_up_proj"][:, 0::2].T)
    assert np.array_equal(mx.up, theirs["gate_up_proj"][:, 1::2].T)
    assert np.array_equal(mx.down, theirs["down_proj"].T)

    # Scales that do not pair with the blocks (one per row, not per block) would broadcast:
    # refused by shape.
    short = {**{f"{n}_blocks": (b, "U8") for n, b in blocks.items()},
             **{f"{n}_scales": (s[..., :1].copy(), "U8") for n, s in scales.items()},
             **biases}
    with pytest.raises(ValueError, match=r"MXFP4 blocks \[64, 2, 16\] and scales \[64, 1\]"):
        clamped(short).clamped_swiglu_weights()
    with pytest.raises(ValueError, match="gate_up_proj_blocks"):
        clamped({"gate_up_proj_blocks": (blocks["gate_up_proj"], "U8"), **biases}
                ).clamped_swiglu_weights()
    with pytest.raises(ValueError, match="EXPERT_ACTIVATION_SWIGLU"):
        _slot({"gate_proj": (down.T.copy(), "BF16")}).clamped_swiglu_weights()
