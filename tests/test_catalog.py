"""The catalog reads every listed layout in its real naming, refuses broken checkpoints with
messages naming file and tensor, and leaves nothing half-registered."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dpu_agent.weights.catalog import MAX_JSON_BYTES, build_catalog
from dpu_agent.weights.ingest import MANIFEST_FILE, attach_manifest
from dpu_agent.weights.layouts import SWIGLU, Activation, LayoutError
from dpu_agent.weights.safetensors_file import CheckpointError
from dpu_offload.blob import BLOB_ALIGN
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from tests.conftest import checkpoint_bytes

LAYOUTS = [
    # spec, moe layers, roles, tensor-name pattern of role 0 for (layer, expert)
    (CheckpointSpec("qwen3-moe", layers=3, experts=4), [0, 1, 2], 3,
     "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"),
    (CheckpointSpec("qwen2-moe", layers=2, experts=4), [0, 1], 3,
     "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"),
    (CheckpointSpec("mixtral", layers=2, experts=4), [0, 1], 3,
     "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight"),
    (CheckpointSpec("deepseek-v3", layers=3, experts=4, dense_layers=1), [1, 2], 3,
     "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"),
    (CheckpointSpec("deepseek-v3", layers=3, experts=4, dtype="fp8", hidden=256,
                    intermediate=256), [1, 2], 6,
     "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"),
    (CheckpointSpec("olmoe", layers=2, experts=4), [0, 1], 3,
     "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"),
    (CheckpointSpec("gpt-oss", layers=2, experts=4), [0, 1], 4, None),
]


@pytest.mark.parametrize("spec,moe,roles,name0", LAYOUTS,
                         ids=[f"{s.arch}-{s.dtype}" for s, *_ in LAYOUTS])
def test_layouts_split_into_exact_blobs(tmp_path: Path, spec: CheckpointSpec, moe: list[int],
                                        roles: int, name0: str | None) -> None:
    root = make_checkpoint(tmp_path / spec.arch, spec)
    cat = build_catalog(root)
    assert list(cat.layout.moe_layers) == moe
    assert len(cat.experts) == len(moe) * spec.experts
    assert (cat.layout.activation.kind == "clamped_swiglu") == (spec.arch == "gpt-oss")
    assert spec.arch == "gpt-oss" or cat.layout.activation == SWIGLU
    truth = checkpoint_bytes(root)
    for entry in cat.experts.values():
        assert len(entry.tensors) == roles and entry.blob_bytes % BLOB_ALIGN == 0
        for t in entry.tensors:
            assert t.offset % BLOB_ALIGN == 0
            got = t.file.read_bytes()[t.file_offset:t.file_offset + t.nbytes]
            if spec.arch == "gpt-oss":
                stacked = truth[f"model.layers.{entry.key.layer}.mlp.experts.{t.role}"]
                want = stacked[entry.key.expert * t.nbytes:(entry.key.expert + 1) * t.nbytes]
            else:
                want = None
            if want is not None:
                assert got == want, (entry.key, t.role)
        if name0:
            name = name0.format(l=entry.key.layer, e=entry.key.expert)
            t0 = entry.tensors[0]
            assert t0.file.read_bytes()[t0.file_offset:t0.file_offset + t0.nbytes] == truth[name]
    if spec.arch == "qwen2-moe":
        assert cat.layout.shared_experts_per_layer == 1


def _ckpt(tmp_path: Path, **kw: object) -> Path:
    return make_checkpoint(tmp_path / "m", CheckpointSpec("qwen3-moe", layers=2, experts=3, **kw))


def _edit_index(root: Path, fn) -> None:
    p = root / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    fn(idx["weight_map"])
    p.write_text(json.dumps(idx))


def test_refusals_name_file_and_tensor(tmp_path: Path) -> None:
    root = _ckpt(tmp_path)
    shard = sorted(root.glob("*.safetensors"))[0]

    broken = tmp_path / "truncated"
    shutil.copytree(root, broken)
    (broken / shard.name).write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*past the end"):
        build_catalog(broken)

    bad_header = tmp_path / "header"
    shutil.copytree(root, bad_header)
    raw = bytearray(shard.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    raw[:8] = struct.pack("<Q", hlen + 10**9)
    (bad_header / shard.name).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="header length"):
        build_catalog(bad_header)

    missing = tmp_path / "missing"
    shutil.copytree(root, missing)
    _edit_index(missing, lambda wm: wm.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(LayoutError, match=r"layer 1 expert 2 lacks "
                                         r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        build_catalog(missing)

    absent = tmp_path / "absent"
    shutil.copytree(root, absent)
    _edit_index(absent, lambda wm: wm.__setitem__("extra.weight",
                                                  "model-00009-of-00009.safetensors"))
    with pytest.raises(CheckpointError, match="absent shard"):
        build_catalog(absent)

    dup = tmp_path / "dup"
    shutil.copytree(root, dup)
    text = (dup / "model.safetensors.index.json").read_text()
    (dup / "model.safetensors.index.json").write_text(
        text.replace('"weight_map": {', '"weight_map": {"model.embed_tokens.weight": "x",', 1))
    with pytest.raises(CheckpointError, match=r"duplicated key 'model\.embed_tokens\.weight'"):
        build_catalog(dup)

    # JSON files are bounded before they are read (sparse files: no disk spent).
    for name in ("config.json", "model.safetensors.index.json", MANIFEST_FILE):
        huge = tmp_path / f"huge-{name}"
        shutil.copytree(root, huge)
        with open(huge / name, "r+b" if (huge / name).exists() else "wb") as f:
            f.truncate(MAX_JSON_BYTES + 1)
        with pytest.raises(CheckpointError, match=rf"{name}: {MAX_JSON_BYTES + 1} bytes, more"):
            attach_manifest(build_catalog(huge))

    wrong_shape = tmp_path / "shape"
    shutil.copytree(root, wrong_shape)
    cfg = json.loads((wrong_shape / "config.json").read_text())
    cfg["moe_intermediate_size"] = 64
    (wrong_shape / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight' has shape .*config implies"):
        build_catalog(wrong_shape)

    # An unknown model_type is read by its names (the count from the tensors); names that
    # follow no expert pattern are refused, saying what was expected.
    unknown = tmp_path / "unknown"
    shutil.copytree(root, unknown)
    (unknown / "config.json").write_text('{"model_type": "bert"}')
    cat = build_catalog(unknown)
    assert (cat.layout.architecture, cat.layout.experts_per_layer) == ("bert", 3)
    assert cat.layout.pattern == ("model.layers.{L}.mlp.experts.{E}."
                                  "{down_proj.weight,gate_proj.weight,up_proj.weight}")
    renamed = tmp_path / "renamed"
    shutil.copytree(root, renamed)
    _edit_index(renamed, lambda wm: [wm.__setitem__(k.replace("experts", "ffn"), wm.pop(k))
                                     for k in list(wm)])
    for shard_file in renamed.glob("*.safetensors"):
        shard_file.unlink()  # the index alone names the tensors
    with pytest.raises(LayoutError, match=r"no expert tensors .*experts\.\{E\}"):
        build_catalog(renamed, require_shards=False)


def test_fp8_config_with_bf16_weights_is_refused(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ds", CheckpointSpec("deepseek-v3", layers=2, experts=2))
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="is BF16, config says fp8"):
        build_catalog(root)


def _deepseek_v3_index(root: Path) -> Path:
    root.mkdir(parents=True)
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "first_k_dense_replace": 3,
           "moe_layer_freq": 1, "n_routed_experts": 256, "n_shared_experts": 1,
           "hidden_size": 7168, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (root / "config.json").write_text(json.dumps(cfg))
    wm = {}
    for layer in range(3, 61):
        for e in range(256):
            for role in ("gate_proj", "up_proj", "down_proj"):
                for suffix in ("weight", "weight_scale_inv"):
                    wm[f"model.layers.{layer}.mlp.experts.{e}.{role}.{suffix}"] = \
                        f"model-{layer:05d}-of-00163.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return root


def test_inspect_deepseek_v3_index_only_small(tmp_path: Path) -> None:
    root = _deepseek_v3_index(tmp_path / "dsv3")
    cat = build_catalog(root, require_shards=False)
    assert len(cat.experts) == 58 * 256
    # VmHWM, not ru_maxrss: the latter carries the (large) pytest parent's peak across exec.
    code = ("from dpu_agent.weights.catalog import build_catalog; "
            f"c = build_catalog({str(root)!r}, require_shards=False); "
            "print(next(x.split()[1] for x in open('/proc/self/status') "
            "if x.startswith('VmHWM')))")
    rss_kb = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)
    assert rss_kb < 300 * 1024, f"{rss_kb / 1024:.0f} MB resident"
    out = subprocess.run([sys.executable, "-m", "dpu_agent.cli", "inspect", str(root), "--json"],
                         capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert info["architecture"] == "deepseek_v3" and not info["stacked"]
    assert info["activation"] == {"kind": "swiglu", "alpha": 0.0, "limit": 0.0}
    assert info["pattern"] == ("model.layers.{L}.mlp.experts.{E}.{down_proj.weight,"
                               "down_proj.weight_scale_inv,gate_proj.weight,"
                               "gate_proj.weight_scale_inv,up_proj.weight,"
                               "up_proj.weight_scale_inv}")
    assert info["moe_layers"] == list(range(3, 61))
    assert info["experts_per_layer"] == 256 and info["shared_experts_per_layer"] == 1
    # 3 x 7168 x 2048 FP8 bytes + 3 F32 scale tensors of 16 x 56 (3584 B, already aligned).
    assert info["expert_bytes"] == 3 * 7168 * 2048 + 3 * 3584
    assert info["total_expert_bytes"] == info["expert_bytes"] * 58 * 256


def test_inspect_refuses_non_checkpoint(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "dpu_agent.cli", "inspect", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "config.json: missing" in res.stderr


def test_hand_written_llama4_stacked_layout(tmp_path: Path) -> None:
    import numpy as np
    import safetensors

    root = tmp_path / "llama4"
    root.mkdir()
    e, h, i = 4, 32, 16
    cfg = {"model_type": "llama4", "text_config": {
        "num_hidden_layers": 2, "interleave_moe_layer_step": 2, "num_local_experts": e,
        "hidden_size": h, "intermediate_size": i, "num_experts_per_tok": 1}}
    (root / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((e, h, 2 * i), dtype=np.float32)
    down = rng.standard_normal((e, i, h), dtype=np.float32)
    prefix = "language_model.model.layers.1.feed_forward.experts"
    arrays = {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}
    specs = {n: safetensors.TensorSpec(dtype="float32", shape=list(a.shape),
                                       data_ptr=a.ctypes.data, data_len=a.nbytes)
             for n, a in arrays.items()}
    safetensors.serialize_file(specs, str(root / "model-00001-of-00001.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00001.safetensors" for n in arrays}}))
    cat = build_catalog(root)
    assert list(cat.layout.moe_layers) == [1] and len(cat.experts) == e
    for entry in cat.experts.values():
        gu, dn = entry.tensors
        assert (gu.role, gu.shape, dn.shape) == ("gate_up_proj", (h, 2 * i), (i, h))
        got = gu.file.read_bytes()[gu.file_offset:gu.file_offset + gu.nbytes]
        assert got == gate_up[entry.key.expert].tobytes()
        got = dn.file.read_bytes()[dn.file_offset:dn.file_offset + dn.nbytes]
        assert got == down[entry.key.expert].tobytes()


def test_gpt_oss_as_released_mxfp4_blocks_scales_and_biases(tmp_path: Path) -> None:
    """gpt-oss as published: MXFP4 experts (``_blocks`` of 16 bytes per 32 values, one
    ``_scales`` byte per block) with BF16 biases, stacked ``[E, ...]``; each expert's blob holds
    its slice of every tensor, weights first."""
    import numpy as np
    import safetensors

    root = tmp_path / "gpt-oss"
    root.mkdir()
    e, h, i = 4, 64, 32
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 1, "num_local_experts": e,
           "hidden_size": h, "intermediate_size": i, "num_experts_per_tok": 2,
           "quantization_config": {"quant_method": "mxfp4"}}
    (root / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(1)
    p = "model.layers.0.mlp.experts"
    arrays = {
        f"{p}.gate_up_proj_blocks": rng.integers(0, 256, (e, 2 * i, h // 32, 16), np.uint8),
        f"{p}.gate_up_proj_scales": rng.integers(0, 256, (e, 2 * i, h // 32), np.uint8),
        f"{p}.gate_up_proj_bias": rng.integers(0, 1 << 16, (e, 2 * i), np.uint16),
        f"{p}.down_proj_blocks": rng.integers(0, 256, (e, h, i // 32, 16), np.uint8),
        f"{p}.down_proj_scales": rng.integers(0, 256, (e, h, i // 32), np.uint8),
        f"{p}.down_proj_bias": rng.integers(0, 1 << 16, (e, h), np.uint16),
        "model.layers.0.mlp.router.weight": rng.integers(0, 1 << 16, (e, h), np.uint16)}
    specs = {n: safetensors.TensorSpec(dtype="uint8" if a.dtype == np.uint8 else "bfloat16",
                                       shape=list(a.shape), data_ptr=a.ctypes.data,
                                       data_len=a.nbytes) for n, a in arrays.items()}
    safetensors.serialize_file(specs, str(root / "model.safetensors"))
    cat = build_catalog(root)
    assert cat.layout.stacked and cat.layout.moe_layers == (0,) and len(cat.experts) == e
    # gpt-oss's activation with its config's constants (transformers' defaults when absent)
    assert cat.layout.activation == Activation("clamped_swiglu", 1.702, 7.0)
    for bad in ("seven", -1.0, float("inf"), True):
        (root / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": bad}))
        with pytest.raises(LayoutError, match="'swiglu_limit' must be a positive number"):
            build_catalog(root)
    (root / "config.json").write_text(json.dumps(cfg))
    for entry in cat.experts.values():
        assert entry.activation == cat.layout.activation
        assert [t.role for t in entry.tensors] == [
            "gate_up_proj_blocks", "down_proj_blocks", "gate_up_proj_scales",
            "down_proj_scales", "gate_up_proj_bias", "down_proj_bias"]
        for t in entry.tensors:
            want = arrays[f"{p}.{t.role}"][entry.key.expert]
            assert t.shape == want.shape
            assert t.file.read_bytes()[t.file_offset:t.file_offset + t.nbytes] == want.tobytes()


def test_make_checkpoint_cli(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "host_client.cli", "make-checkpoint",
                          str(tmp_path / "ds"), "--arch", "deepseek-v3", "--dtype", "fp8",
                          "--layers", "3", "--experts", "4", "--hidden", "256",
                          "--intermediate", "128"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cat = build_catalog(tmp_path / "ds")
    assert cat.layout.architecture == "deepseek_v3" and len(cat.experts) == 2 * 4
    assert [t.dtype for t in next(iter(cat.experts.values())).tensors] == ["F8_E4M3"] * 3 + \
        ["F32"] * 3
    bad = subprocess.run([sys.executable, "-m", "host_client.cli", "make-checkpoint",
                          str(tmp_path / "x"), "--arch", "bert"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    for layers, msg in (("0", "must be positive, got 0"),
                        ("four", "must be a positive integer, got 'four'")):
        bad = subprocess.run([sys.executable, "-m", "host_client.cli", "make-checkpoint",
                              str(tmp_path / "y"), "--arch", "mixtral", "--layers", layers],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and f"--layers: {msg}" in bad.stderr
        assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("edit,msg", [
    # An index-only checkpoint (no shards: the names and the config are all there is).
    (lambda wm, cfg: wm.__setitem__("model.layers.0.mlp.experts.10000000000.gate_proj.weight",
                                    "x.safetensors"), r"expert index 10000000000 is not below"),
    (lambda wm, cfg: wm.__setitem__("model.layers.99999999999999999999.mlp.experts.0."
                                    "gate_proj.weight", "x.safetensors"),
     r"layer \d+ is not below"),
    (lambda wm, cfg: cfg.__setitem__("num_local_experts", 10**12), r"must be an integer in"),
    (lambda wm, cfg: cfg.__setitem__("hidden_size", 2**40), r"hidden size\) must be an integer"),
])
def test_hostile_names_and_counts_are_refused_before_work_is_sized_by_them(
        tmp_path: Path, edit, msg: str) -> None:
    """A tensor name or config count that would size the catalog (a loop per expert, a
    uint32 in the LoadModel response) is bounded first: refused, naming it."""
    root = _ckpt(tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    idx = json.loads((root / "model.safetensors.index.json").read_text())
    edit(idx["weight_map"], cfg)
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))
    for shard in root.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(LayoutError, match=msg):
        build_catalog(root, require_shards=False)
