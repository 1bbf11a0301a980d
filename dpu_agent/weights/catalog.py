"""The expert catalog: a checkpoint directory split into per-expert blobs (docs/LAYOUT.md).

A catalog is built from ``config.json`` + ``model.safetensors.index.json`` (+ shard headers when
the shards are present) and is complete or absent: every check runs before anything is returned,
so a refused model leaves nothing half-registered.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpu_agent.weights.layouts import (
    SWIGLU,
    Activation,
    LayoutError,
    ModelLayout,
    TensorSource,
    discover,
    text_config,
)
from dpu_agent.weights.safetensors_file import (
    DTYPE_BYTES,
    CheckpointError,
    Stamp,
    TensorInfo,
    read_header,
    stamp_of,
)
from dpu_offload.blob import align_up
from dpu_offload.keys import ExpertKey

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class BlobTensor:
    """One tensor inside an expert blob, and where its bytes are in the checkpoint."""

    role: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Bytes from the start of the blob."""
    nbytes: int
    file: Path | None
    """Shard holding the bytes (None when only the index was read)."""
    file_offset: int
    """Absolute byte offset of the bytes in ``file``."""
    stamp: Stamp | None = None
    """``file`` as it was when its header was read (a fill refuses a changed file)."""


@dataclass(frozen=True, slots=True)
class ExpertEntry:
    """An expert's blob layout."""

    key: ExpertKey
    tensors: tuple[BlobTensor, ...]
    blob_bytes: int
    expected: tuple[int, ...] = ()
    """The chunk checksums the ingest manifest recorded (empty without a manifest)."""
    expected_chunk_bytes: int = 0
    activation: Activation = SWIGLU
    """How the expert's FFN computes (its model's, ``ModelLayout.activation``)."""


@dataclass
class ModelCatalog:
    """All experts of one loaded checkpoint."""

    name: str
    path: Path
    layout: ModelLayout
    experts: dict[ExpertKey, ExpertEntry]
    shards_present: bool
    manifest: Path | None = None
    """The ingest manifest the experts' bytes are checked against at each fill."""

    @property
    def expert_bytes(self) -> int:
        """The largest expert blob, bytes."""
        return max((e.blob_bytes for e in self.experts.values()), default=0)

    @property
    def total_expert_bytes(self) -> int:
        return sum(e.blob_bytes for e in self.experts.values())


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise CheckpointError(f"duplicated key {k!r}")
        seen[k] = v
    return seen


MAX_JSON_BYTES = 64 << 20
"""Largest JSON file the agent reads beside a checkpoint (config, shard index, ingest manifest:
DeepSeek-V3's manifest at 1 MiB chunks is about 8 MB)."""


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file, parsed; CheckpointError naming the file when it is missing,
    larger than ``MAX_JSON_BYTES`` (checked before reading), not JSON, or repeats a key."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise CheckpointError(f"{size} bytes, more than the {MAX_JSON_BYTES} a JSON "
                                      "file beside a checkpoint may have")
            text = f.read(MAX_JSON_BYTES + 1).decode()
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from exc
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_FILE
    if index.exists():
        data = read_json(index)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: no 'weight_map' object of tensor -> shard file")
        for shard in set(wm.values()):
            if "/" in shard or shard.startswith("."):
                raise CheckpointError(f"{index}: shard name {shard!r} leaves the directory")
        return wm
    single = directory / SINGLE_FILE
    if single.exists():
        tensors, _ = read_header(single)
        return {name: SINGLE_FILE for name in tensors}
    raise CheckpointError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}")


FP8_BLOCK = 128
"""DeepSeek-V3's FP8 weights carry one F32 ``weight_scale_inv`` per 128 x 128 block."""


def _expected_shape(layout: ModelLayout, src: TensorSource) -> tuple[int, ...] | None:
    """Shape the config implies for one expert's role (a stacked tensor's slice), or None
    when not checked (no sizes in the config, or a quantised block layout)."""
    h, i = layout.hidden_size, layout.intermediate_size
    if not h or not i:
        return None
    shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
              "gate_up_proj": (2 * i, h)}
    if layout.in_out:
        shapes = {role: (cols, rows) for role, (rows, cols) in shapes.items()}
    if src.role in shapes:
        return shapes[src.role]
    base = src.role.removesuffix("_bias")
    if base in shapes:
        return (shapes[base][1 if layout.in_out else 0],)
    base = src.role.removesuffix("_scale_inv")
    if base in shapes:
        rows, cols = shapes[base]
        return (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    return None


MAX_PATH_BYTES = 4096
"""Linux's PATH_MAX; each component at most NAME_MAX_BYTES."""
NAME_MAX_BYTES = 255


def path_problem(path: str) -> str | None:
    """What makes ``path`` unusable as a checkpoint path, before any system call sees it."""
    shown = repr(path[:60]) + ("..." if len(path) > 60 else "")
    if not path:
        return "path is empty"
    if "\0" in path:
        return f"path {shown} holds a NUL character"
    if len(path.encode(errors="surrogateescape")) > MAX_PATH_BYTES:
        return f"path {shown} is longer than {MAX_PATH_BYTES} bytes"
    if any(len(part.encode(errors="surrogateescape")) > NAME_MAX_BYTES
           for part in path.split("/")):
        return f"path {shown} has a component longer than {NAME_MAX_BYTES} bytes"
    return None


def build_catalog(directory: str | Path, name: str | None = None, *,
                  require_shards: bool = True) -> ModelCatalog:
    """Build a model's catalog.

    Args:
        directory: the checkpoint directory.
        name: model name in expert keys; defaults to the directory's name.
        require_shards: refuse when shard files are missing (False for ``inspect`` on an
            index-only directory: sizes then come from the config's shapes and dtype).

    Raises:
        CheckpointError, LayoutError: naming the file and tensor at fault.
    """
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    cfg = read_json(root / "config.json")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{root / 'config.json'}: not a JSON object")
    weight_map = _weight_map(root)
    shard_files = sorted(set(weight_map.values()))
    present = [s for s in shard_files if (root / s).exists()]
    if require_shards and len(present) != len(shard_files):
        missing = sorted(set(shard_files) - set(present))
        raise CheckpointError(f"{root / INDEX_FILE}: names absent shard(s) {missing[:3]}")
    headers: dict[str, dict[str, TensorInfo]] = {}
    stamps: dict[str, Stamp] = {}
    if len(present) == len(shard_files):
        for shard in shard_files:
            stamps[shard] = stamp_of(root / shard)
            headers[shard], _ = read_header(root / shard)
        for tensor, shard in weight_map.items():
            if tensor not in headers[shard]:
                raise CheckpointError(f"{root / shard}: index says it holds {tensor!r}, "
                                      "its header does not")
    layout = discover(cfg, {t: (headers[s][t].shape if s in headers else None)
                            for t, s in weight_map.items()})
    text = text_config(cfg)
    quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
    fp8 = isinstance(quant, dict) and quant.get("quant_method") == "fp8"
    default_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(
        str(text.get("torch_dtype", text.get("dtype", "bfloat16"))), "BF16")
    model = name or root.name
    experts: dict[ExpertKey, ExpertEntry] = {}
    shard_paths = {shard: root / shard for shard in shard_files}  # one Path per shard
    for layer in layout.moe_layers:
        for e in range(layout.experts_per_layer):
            key = ExpertKey(model, layer, e)
            cursor = 0
            tensors: list[BlobTensor] = []
            for src in layout.expert_sources(layer, e):
                if src.tensor not in weight_map:
                    raise CheckpointError(f"{root / INDEX_FILE}: expert {key} lacks tensor "
                                          f"{src.tensor!r}")
                shard = weight_map[src.tensor]
                info = headers.get(shard, {}).get(src.tensor)
                if info is not None:
                    dtype, shape, start, nbytes = info.dtype, info.shape, info.start, info.nbytes
                    if src.index is not None:
                        if not shape or shape[0] != layout.experts_per_layer:
                            raise CheckpointError(
                                f"{root / shard}: stacked tensor {src.tensor!r} has shape "
                                f"{list(shape)}, expected {layout.experts_per_layer} experts "
                                "in dimension 0")
                        shape = shape[1:]
                        nbytes //= layout.experts_per_layer
                        start += nbytes * src.index
                    want = _expected_shape(layout, src)
                    if want is not None and shape != want:
                        raise CheckpointError(f"{root / shard}: tensor {src.tensor!r} has shape "
                                              f"{list(shape)}, config implies {list(want)}")
                    if (fp8 and src.role in ("gate_proj", "up_proj", "down_proj")
                            and dtype != "F8_E4M3"):
                        raise CheckpointError(f"{root / shard}: tensor {src.tensor!r} is "
                                              f"{dtype}, config says fp8")
                    file: Path | None = shard_paths[shard]
                else:
                    want = _expected_shape(layout, src) if src.index is None else None
                    if want is None:
                        raise CheckpointError(f"{root}: cannot size {src.tensor!r} without "
                                              "its shard")
                    dtype = ("F32" if src.role.endswith("_scale_inv")
                             else "F8_E4M3" if fp8 else default_dtype)
                    shape, start, file = want, 0, None
                    nbytes = math.prod(want) * DTYPE_BYTES[dtype]
                offset = align_up(cursor)
                tensors.append(BlobTensor(src.role, dtype, tuple(shape), offset, nbytes, file,
                                          start, stamps.get(shard)))
                cursor = offset + nbytes
            experts[key] = ExpertEntry(key, tuple(tensors), align_up(cursor),
                                       activation=layout.activation)
    if not experts:
        raise LayoutError(f"{root}: config.json describes no MoE layers")
    return ModelCatalog(model, root, layout, experts, bool(headers))
