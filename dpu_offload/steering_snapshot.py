"""The steering snapshot: what the agent programs into the NIC stand-in, published in shared
memory and swapped atomically (docs/ACTIVATIONS.md, "Steering snapshot"; on a BlueField, DOCA
Flow pipe entries the agent adds and removes).

One segment: a 64-byte header, then two halves of ``HALF_BYTES``. The agent writes a new
snapshot into the half not in use and flips ``active`` inside a sequence lock (``seq`` odd
while it flips), so a reader takes the old snapshot or the new one, never a mix, and never
blocks the writer. The NIC writes back two words: ``applied``, the version it now steers by,
and ``drained``, a version below which no message it routed is still unanswered; the agent
retires an expert's old copy only once ``drained`` passed the version that stopped routing to
it (make-before-break under traffic).

A snapshot is one JSON object (control-rate data, read once per version):

- ``version``: int, increasing.
- ``rules``: ``dpu_offload.flows.rule_record`` of every rule.
- ``models``: name -> ``{"index", "hidden", "experts", "layers"}``; ``index`` is the model's
  number in packet headers, ``layers`` its MoE layers.
- ``slots``: ``[device, model, layer, expert, region, offset]`` for every placed copy: where
  the expert lives on that device (stamped into its rx packets).
- ``remotes``: ``[model, layer, expert, "host:port"]``: another agent's NIC that serves an
  expert no local device does (cluster mode).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

from dpu_offload.flows import FlowRule, rule_from_record, rule_record
from dpu_offload.keys import ExpertKey
from dpu_offload.ring import store_fence
from dpu_offload.shm import SharedBuffer, unique_name

MAGIC = 0x46555044
"""``"DPUF"``."""
HEADER_DTYPE = np.dtype({
    "names": ["magic", "active", "seq", "version", "applied", "drained", "length0", "length1"],
    "formats": ["<u4", "<u4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8"],
    "offsets": [0, 4, 8, 16, 24, 32, 40, 48], "itemsize": 64})
HALF_BYTES = 8 << 20
"""Room for one snapshot's JSON, bytes (about 50,000 rules)."""
SEGMENT_BYTES = HEADER_DTYPE.itemsize + 2 * HALF_BYTES
READ_TRIES = 1000


class SnapshotError(ValueError):
    """A snapshot is malformed or too large; the message says what."""


@dataclass(frozen=True)
class ModelEntry:
    """What the NIC checks a frame's model against."""

    index: int
    hidden: int
    """Values per activation row (bf16): a row is ``2 * hidden`` bytes."""
    experts: int
    layers: frozenset[int]


@dataclass(frozen=True)
class Snapshot:
    """One version of the steering state (see the module's docstring)."""

    version: int
    rules: tuple[FlowRule, ...] = ()
    models: dict[str, ModelEntry] = field(default_factory=dict)
    slots: dict[tuple[int, ExpertKey], tuple[int, int]] = field(default_factory=dict)
    """(device id, expert) -> (region id, byte offset) of its placed copy."""
    remotes: dict[ExpertKey, str] = field(default_factory=dict)
    """expert -> ``host:port`` of another agent's NIC."""

    def encode(self) -> bytes:
        return json.dumps({
            "version": self.version,
            "rules": [rule_record(r) for r in self.rules],
            "models": {n: {"index": m.index, "hidden": m.hidden, "experts": m.experts,
                           "layers": sorted(m.layers)} for n, m in self.models.items()},
            "slots": [[d, k.model, k.layer, k.expert, r, o]
                      for (d, k), (r, o) in self.slots.items()],
            "remotes": [[k.model, k.layer, k.expert, a] for k, a in self.remotes.items()],
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Snapshot:
        try:
            d = json.loads(raw)
            return cls(
                int(d["version"]), tuple(rule_from_record(r) for r in d["rules"]),
                {str(n): ModelEntry(int(m["index"]), int(m["hidden"]), int(m["experts"]),
                                    frozenset(int(la) for la in m["layers"]))
                 for n, m in d["models"].items()},
                {(int(dv), ExpertKey(str(m), int(la), int(e))): (int(r), int(o))
                 for dv, m, la, e, r, o in d["slots"]},
                {ExpertKey(str(m), int(la), int(e)): str(a) for m, la, e, a in d["remotes"]})
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"malformed steering snapshot: {exc}") from exc


class SnapshotSegment:
    """The shared segment: the agent creates it (``create``) and publishes; the NIC opens it
    by name and reads, acknowledging with ``applied`` / ``drained``."""

    def __init__(self, name: str | None = None) -> None:
        self.buffer = (SharedBuffer(unique_name("dpu-steer"), SEGMENT_BYTES, create=True)
                       if name is None else SharedBuffer(name, SEGMENT_BYTES))
        self.header = self.buffer.array[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
        self._words = self.buffer.array[:HEADER_DTYPE.itemsize].view("<u8")
        """The header as u64 words (``version`` @16, ``applied`` @24, ``drained`` @32): the
        NIC reads and writes these on every pass, where a structured field costs microseconds."""
        if name is None:
            self.header["magic"] = MAGIC
        elif int(self.header["magic"]) != MAGIC:
            raise SnapshotError(f"{name} is not a steering snapshot (magic "
                                f"{int(self.header['magic']):#x})")

    @property
    def name(self) -> str:
        return self.buffer.name

    def _half(self, index: int) -> np.ndarray:
        start = HEADER_DTYPE.itemsize + index * HALF_BYTES
        return self.buffer.array[start:start + HALF_BYTES]

    def publish(self, snapshot: Snapshot) -> None:
        """Write ``snapshot`` into the idle half and make it the active one (agent side; one
        writer)."""
        raw = snapshot.encode()
        if len(raw) > HALF_BYTES:
            raise SnapshotError(f"steering snapshot of {len(raw)} bytes exceeds {HALF_BYTES}")
        h = self.header
        idle = 1 - int(h["active"])
        self._half(idle)[:len(raw)] = np.frombuffer(raw, np.uint8)
        h[f"length{idle}"] = len(raw)
        store_fence()
        h["seq"] += 1
        store_fence()
        h["active"] = idle
        h["version"] = snapshot.version
        store_fence()
        h["seq"] += 1

    @property
    def version(self) -> int:
        """The version published last (one word: the NIC's per-pass check)."""
        return int(self._words[2])

    def read(self) -> Snapshot:
        """The active snapshot, read consistently (NIC side)."""
        h = self.header
        for _ in range(READ_TRIES):
            seq = int(h["seq"])
            if seq % 2:
                time.sleep(0)
                continue
            store_fence()
            active = int(h["active"])
            length = int(h[f"length{active}"])
            if length > HALF_BYTES:
                raise SnapshotError(f"snapshot length {length} exceeds {HALF_BYTES}")
            raw = self._half(active)[:length].tobytes()
            store_fence()
            if int(h["seq"]) == seq:
                return Snapshot.decode(raw) if length else Snapshot(0)
        raise SnapshotError("the steering snapshot kept changing while being read")

    def acknowledge(self, applied: int, drained: int) -> None:
        """The NIC's answer: the version it steers by; no message routed under an earlier
        version than ``drained`` is unanswered."""
        self._words[3] = applied
        self._words[4] = drained

    @property
    def drained(self) -> int:
        return int(self._words[4])

    @property
    def applied(self) -> int:
        return int(self._words[3])

    def close(self) -> None:
        self.buffer.close()

    def unlink(self) -> None:
        self.buffer.unlink()

