"""Zero-copy reading of safetensors shards: the header parsed and checked, tensors as views of a
memory map (never the whole file in Python memory).

The safetensors library's own loaders cannot hand out BF16 or FP8 tensors as NumPy arrays, and
the agent needs byte ranges anyway, so the (documented, tiny) header is read here and every
field is validated against the file.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import threading
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


class ShardChanged(CheckpointError):
    """A shard is no longer the file the catalog was built from (shortened, rewritten,
    replaced or gone): its experts cannot be served until the model is loaded again.

    Attributes:
        path: the shard.
        what: how it changed ("shortened since load", "gone since load", ...).
    """

    def __init__(self, path: Path, what: str, detail: str = "") -> None:
        super().__init__(f"{path}: {what}{f' ({detail})' if detail else ''}")
        self.path, self.what = path, what


Stamp = tuple[int, int, int, int]
"""(device, inode, size, mtime in ns) of a shard when its header was read."""


def stamp_of(path: Path) -> Stamp:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ShardReader:
    """Reads byte ranges of a checkpoint's shards into caller buffers with ``pread``: a file
    shortened, rewritten or replaced since it was stamped is a :class:`ShardChanged` naming
    it, never a fault of the process (a memory map of a truncated file raises SIGBUS)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Fill threads read concurrently; the table of descriptors is shared."""
        self._fds: dict[Path, tuple[int, tuple[int, int]]] = {}
        """path -> (open descriptor, its (device, inode)); reopened when the path names
        another file (a model loaded again after its shard was replaced)."""
        self._retired: list[int] = []
        """Descriptors of replaced files: another thread may still read through one, so they
        are closed with the reader, not on replacement."""

    def read_into(self, path: Path, start: int, out: np.ndarray,
                  stamp: Stamp | None = None) -> None:
        """Fill ``out`` (``uint8``, contiguous) from ``path`` at byte ``start``; with
        ``stamp``, first check that the file is still the one stamped."""
        try:
            if stamp is not None and stamp_of(path) != stamp:
                raise ShardChanged(path, "changed since load",
                                   "size, modification time or inode differ")
            with self._lock:
                fd, inode = self._fds.get(path, (-1, (0, 0)))
                if fd < 0 or (stamp is not None and stamp[:2] != inode):
                    if fd >= 0:
                        self._retired.append(fd)
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    st = os.fstat(fd)
                    self._fds[path] = fd, (st.st_dev, st.st_ino)
        except FileNotFoundError as exc:
            raise ShardChanged(path, "gone since load") from exc
        view = memoryview(out).cast("B")
        done = 0
        while done < view.nbytes:
            got = os.preadv(fd, [view[done:]], start + done)
            if got == 0:
                raise ShardChanged(path, "shortened since load",
                                   f"ends before byte {start + view.nbytes}")
            done += got

    def close(self) -> None:
        with self._lock:
            for fd in [fd for fd, _ in self._fds.values()] + self._retired:
                os.close(fd)
            self._fds.clear()
            self._retired.clear()
