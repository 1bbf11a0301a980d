"""Zero-copy reading of safetensors shards: the header parsed and checked, tensors as views of a
memory map (never the whole file in Python memory).

The safetensors library's own loaders cannot hand out BF16 or FP8 tensors as NumPy arrays, and
the agent needs byte ranges anyway, so the (documented, tiny) header is read here and every
field is validated against the file.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file or index is malformed; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a shard: dtype, shape, and its byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset in the file."""
    nbytes: int

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def read_header(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """Parse and validate a shard's header.

    Returns:
        (tensors by name, file size in bytes).

    Raises:
        CheckpointError: truncated file, bad JSON, unknown dtype, offsets past the end of the
            file, overlapping tensors, or a byte count that disagrees with dtype x shape.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (no header length)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER or 8 + hlen > size:
                raise CheckpointError(f"{path}: header length {hlen} runs past the file "
                                      f"({size} bytes)")
            raw = f.read(hlen)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + hlen
    tensors: dict[str, TensorInfo] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = spec["dtype"]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed entry") from exc
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise CheckpointError(f"{path}: tensor {name!r} has negative shape or offsets")
        expected = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]
        if end - begin != expected:
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes but "
                                  f"{dtype}{list(shape)} needs {expected}")
        if data_start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {data_start + end}, "
                                  f"past the end of the file ({size} bytes)")
        tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, end - begin)
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap")
    return tensors, size


class ShardMap:
    """Read-only memory maps of a checkpoint's shards, opened on first use."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.ndarray] = {}

    def bytes_of(self, path: Path, start: int, nbytes: int) -> np.ndarray:
        """``uint8[nbytes]`` view of a shard's bytes (no copy)."""
        arr = self._maps.get(path)
        if arr is None:
            fd = os.open(path, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
            arr = np.frombuffer(mm, dtype=np.uint8)
            self._maps[path] = arr
        if start + nbytes > arr.size:
            raise CheckpointError(f"{path}: shrank to {arr.size} bytes while in use")
        return arr[start : start + nbytes]

    def close(self) -> None:
        self._maps.clear()
