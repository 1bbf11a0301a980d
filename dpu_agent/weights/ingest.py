"""Ingest: read every expert of a checkpoint, compute its per-chunk checksums and write the
manifests (one JSON file, written atomically; ``MANIFEST_FILE`` beside the checkpoint by
default). Shows a progress bar on a terminal. A manifest found beside a checkpoint at
LoadModel is attached to its catalog (:func:`attach_manifest`): every fill is then checked
against it, which catches bytes changed in place that no file stamp shows."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from dpu_agent.weights.catalog import ExpertEntry, ModelCatalog, read_json
from dpu_agent.weights.safetensors_file import CheckpointError, ShardReader
from dpu_offload.checksum import blob_checksums
from dpu_offload.keys import ExpertKey


def ingest(catalog: ModelCatalog, chunk_bytes: int, *, show_progress: bool = True
           ) -> dict[str, Any]:
    """Manifests of every expert: tensors and chunk checksums. Reads each expert's bytes once
    (``pread``) into one reused blob buffer."""
    shards = ShardReader()
    blob = np.zeros(catalog.expert_bytes, np.uint8)
    experts: dict[str, Any] = {}
    start = time.perf_counter()
    progress = Progress(TextColumn("ingest {task.fields[model]}"), BarColumn(),
                        TextColumn("{task.completed:.0f}/{task.total:.0f} B"),
                        TransferSpeedColumn(), TimeRemainingColumn(),
                        disable=not show_progress)
    with progress:
        task = progress.add_task("ingest", total=catalog.total_expert_bytes, model=catalog.name)
        for key, entry in catalog.experts.items():
            view = blob[:entry.blob_bytes]
            view[:] = 0
            for t in entry.tensors:
                if t.file is None:
                    raise FileNotFoundError(f"{key}: shard of {t.role} is not present")
                shards.read_into(t.file, t.file_offset, view[t.offset:t.offset + t.nbytes],
                                 t.stamp)
            experts[_manifest_key(key)] = {
                "blob_bytes": entry.blob_bytes,
                "tensors": _tensor_records(entry),
                "chunk_checksums": blob_checksums(view, chunk_bytes),
            }
            progress.advance(task, entry.blob_bytes)
    shards.close()
    return {"model": catalog.name, "architecture": catalog.layout.architecture,
            "chunk_bytes": chunk_bytes, "seconds": time.perf_counter() - start,
            "experts": experts}


MANIFEST_FILE = "dpu-manifest.json"
"""Where ``dpu-agent ingest`` writes a checkpoint's manifest, and LoadModel looks for it."""


def attach_manifest(catalog: ModelCatalog) -> ModelCatalog:
    """``catalog`` with each expert's manifest checksums attached when ``MANIFEST_FILE`` lies
    beside the checkpoint (unchanged without one). CheckpointError when the manifest does not
    describe this checkpoint (another model, other tensors or sizes)."""
    path = catalog.path / MANIFEST_FILE
    if not path.exists():
        return catalog
    manifest = read_json(path)
    try:
        chunk = int(manifest["chunk_bytes"])
        experts = manifest["experts"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not an ingest manifest ({exc})") from exc
    if chunk <= 0 or chunk % 16:
        raise CheckpointError(f"{path}: chunk_bytes {chunk} is not a positive multiple of 16")
    attached = {}
    for key, entry in catalog.experts.items():
        got = experts.get(_manifest_key(key))
        sums = got.get("chunk_checksums") if isinstance(got, dict) else None
        if (not isinstance(got, dict) or got.get("blob_bytes") != entry.blob_bytes
                or got.get("tensors") != _tensor_records(entry) or not isinstance(sums, list)
                or len(sums) != -(-entry.blob_bytes // chunk)
                or not all(type(s) is int and 0 <= s < 1 << 32 for s in sums)):
            raise CheckpointError(f"{path}: does not describe expert l{key.layer}-e{key.expert} "
                                  "of this checkpoint as it is (run dpu-agent ingest again)")
        attached[key] = replace(entry, expected=tuple(sums),
                                expected_chunk_bytes=chunk)
    return replace(catalog, experts=attached, manifest=path)


def _tensor_records(entry: ExpertEntry) -> list[dict[str, Any]]:
    """How a manifest describes an expert's tensors (compared as written at LoadModel)."""
    return [{"name": t.role, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
             "nbytes": t.nbytes} for t in entry.tensors]


def _manifest_key(key: ExpertKey) -> str:
    """Experts are keyed by layer and index in a manifest (the model's name is the loader's)."""
    return f"l{key.layer}-e{key.expert}"


def write_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Temp file, fsync, rename: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
