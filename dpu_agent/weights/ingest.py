"""Ingest: read every expert of a checkpoint through memory maps, compute its per-chunk
checksums and write the manifests (one JSON file, written atomically). Shows a progress bar
on a terminal."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from dpu_agent.weights.catalog import ModelCatalog
from dpu_agent.weights.safetensors_file import ShardReader
from gpu_kernels.checksum import blob_checksums


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
            experts[str(key)] = {
                "blob_bytes": entry.blob_bytes,
                "tensors": [{"name": t.role, "dtype": t.dtype, "shape": list(t.shape),
                             "offset": t.offset, "nbytes": t.nbytes} for t in entry.tensors],
                "chunk_checksums": blob_checksums(view, chunk_bytes),
            }
            progress.advance(task, entry.blob_bytes)
    shards.close()
    return {"model": catalog.name, "architecture": catalog.layout.architecture,
            "chunk_bytes": chunk_bytes, "seconds": time.perf_counter() - start,
            "experts": experts}


def write_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Temp file, fsync, rename: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
