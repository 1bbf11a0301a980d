"""Host-client memory: the rings it allocates for the agent to write into, and the expert slots
it hands to inference code as array views (NumPy, CuPy, or torch through DLPack; no copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dpu_offload import abi
from dpu_offload.keys import ExpertKey
from dpu_offload.port_bell import PortBell
from dpu_offload.ring import Ring
from dpu_offload.shm import SharedBuffer, session_name, unique_name
from dpu_offload.v1 import agent_pb2 as pb
from gpu_kernels import gpt_oss, reference

NUMPY_DTYPES: dict[str, Any] = {
    "BF16": np.uint16,  # raw bits; NumPy has no bfloat16 (torch views get the real dtype)
    "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "U8": np.uint8, "I8": np.int8,
    "I32": np.int32, "I64": np.int64,
}
TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U8": "uint8"}


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor lies in an expert blob: ``offset`` and ``nbytes`` in bytes, ``shape``,
    safetensors ``dtype``."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


def tensor_layout(manifest: pb.ExpertManifest, name: str) -> TensorLayout:
    """The layout of tensor ``name`` of an expert blob. ``gate_up_proj`` is also found where a
    per-expert checkpoint gave ``gate_proj`` and ``up_proj`` lying side by side: one
    ``[2I, H]`` tensor, gate rows first (transformers 5's fused layout). KeyError naming the
    blob's tensors otherwise."""
    tensors = {t.name: t for t in manifest.tensors}
    t = tensors.get(name)
    if t is not None:
        return TensorLayout(t.offset, t.nbytes, tuple(t.shape), t.dtype)
    gate, up = tensors.get("gate_proj"), tensors.get("up_proj")
    if (name == "gate_up_proj" and gate is not None and up is not None
            and up.offset == gate.offset + gate.nbytes and list(up.shape) == list(gate.shape)
            and up.dtype == gate.dtype):
        return TensorLayout(gate.offset, 2 * gate.nbytes,
                            (2 * gate.shape[0], *gate.shape[1:]), gate.dtype)
    key = f"{manifest.key.model}/l{manifest.key.layer}-e{manifest.key.expert}"
    raise KeyError(f"{key}: no tensor {name!r} (the blob holds {sorted(tensors)})")


class SharedRing:
    """A ring in POSIX shared memory owned by this process; ``name`` is its export handle.

    Args:
        token: the session's token, to which the segment's name is bound
            (``shm.session_name``: the agent registers it for that session only); "" for a
            ring no agent registers (a test's own).

    Attributes:
        bell: a packet ring's doorbell FIFO (``dpu_offload.port_bell``), made before the
            segment; None for other kinds, or where FIFOs cannot be made.
    """

    def __init__(self, kind: abi.RingKind, capacity: int, entry_size: int | None = None,
                 token: str = "") -> None:
        size = abi.ring_bytes(capacity, entry_size or abi.entry_dtype_for(kind).itemsize)
        prefix = f"dpu-ring-{kind.name.lower()}"
        name = session_name(prefix, token) if token else unique_name(prefix)
        packets = kind in (abi.RingKind.RX_PACKET, abi.RingKind.TX_PACKET)
        self.bell = PortBell.create(name) if packets else None
        buffer = None
        try:
            buffer = SharedBuffer(name, size, create=True)
            self.ring = Ring.format(buffer.array, kind, capacity, entry_size)
        except BaseException:  # a refused capacity or entry size leaves no file behind
            if buffer is not None:
                buffer.unlink()
                buffer.close()
            self._close_bell()
            raise
        self.buffer = buffer

    @property
    def name(self) -> str:
        return self.buffer.name

    @property
    def size(self) -> int:
        return self.buffer.size

    def close(self) -> None:
        self.ring.doorbell = False
        self._close_bell()
        self.buffer.unlink()
        self.buffer.close()

    def _close_bell(self) -> None:
        if self.bell is not None:
            self.bell.unlink()
            self.bell.close()


@dataclass(frozen=True)
class SlotPoolSpec:
    """One size class of expert slots on a device."""

    slot_bytes: int
    """Bytes per slot, a multiple of 256 (``dpu_offload.blob.BLOB_ALIGN``)."""
    slot_count: int
    home_layers: tuple[int, ...] = ()
    """Optional homes: the pool cut into ``len(home_layers)`` equal runs of consecutive slots
    (``slot_count`` a multiple of it), the i-th kept for the experts of layer
    ``home_layers[i]``: a miss of that layer takes a slot of its home (free, else the idle one
    the agent's policy names there) and one elsewhere only when its home has none, so a layer's
    experts can be computed over their home's views alone (``PoolViews.home``)."""


@dataclass(frozen=True)
class ClampedSwiGLU:
    """A gpt-oss expert's weights (``ExpertSlot.clamped_swiglu_weights``), ``float32``
    arrays of the slot's kind (NumPy or CuPy): gate ``[I, H]``, up ``[I, H]``, down
    ``[H, I]``, gate_bias ``[I]``, up_bias ``[I]``, down_bias ``[H]``; ``alpha`` and
    ``limit`` of its activation (``gpu_kernels.gpt_oss.clamped_swiglu_f32_weights`` says the
    formula)."""

    gate: Any
    up: Any
    down: Any
    gate_bias: Any
    up_bias: Any
    down_bias: Any
    alpha: float
    limit: float


_LAYOUTS: dict[int, tuple[pb.ExpertManifest, tuple[Any, ...]]] = {}
"""id(manifest) -> (the manifest, kept so that its id is not reused; its blob layout)."""
_INTERNED: dict[tuple[Any, ...], tuple[Any, ...]] = {}
"""Each distinct blob layout once, so that equal layouts are the same object."""
MAX_LAYOUTS = 1 << 16
"""Manifests whose layouts are remembered before the memo starts again (a client describes
each expert once per agent session)."""


def blob_layout(manifest: pb.ExpertManifest) -> tuple[Any, ...]:
    """The manifest's blob size and each tensor's (name, offset, bytes, shape, dtype), one
    object per distinct layout (compare with ``is``); remembered per manifest object, since
    a slot compares them on every change of expert."""
    got = _LAYOUTS.get(id(manifest))
    if got is None:
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.clear()
            _INTERNED.clear()  # a slot holding an older layout only rebuilds its views once
        layout = (manifest.blob_bytes, *((t.name, t.offset, t.nbytes, tuple(t.shape), t.dtype)
                                         for t in manifest.tensors))
        got = _LAYOUTS[id(manifest)] = (manifest, _INTERNED.setdefault(layout, layout))
    return got[1]


class ExpertSlot:
    """An expert's bytes in a device slot, viewed by tensor (shapes and dtypes from the
    manifest).

    Attributes:
        key: the expert.
        blob: ``uint8[blob_bytes]`` view of the slot (NumPy on the CPU reference device, CuPy on
            a GPU).
        manifest: the agent's ``ExpertManifest``.
        where: (region id, byte offset) of the slot on its device; None where it is not one.
    """

    def __init__(self, key: ExpertKey, blob: Any, manifest: pb.ExpertManifest,
                 where: tuple[int, int] | None = None) -> None:
        self.key = key
        self.blob = blob
        self.manifest = manifest
        self.where = where
        self._layouts: dict[str, TensorLayout] = {}
        self._views: dict[str, Any] = {}

    def holding(self, key: ExpertKey, manifest: pb.ExpertManifest) -> ExpertSlot | None:
        """This slot's place holding ``key`` instead: a new slot on the same blob that shares
        this one's tensor views (a CuPy view costs the host 10-30 us to make), or None where
        ``manifest`` lays its tensors out otherwise."""
        if manifest is not self.manifest and \
                blob_layout(manifest) is not blob_layout(self.manifest):
            return None
        slot = ExpertSlot(key, self.blob, manifest, self.where)
        slot._layouts, slot._views = self._layouts, self._views
        return slot

    @property
    def names(self) -> list[str]:
        """The roles of the expert's tensors, in blob order (``gate_proj``, ``down_proj``...)."""
        return [t.name for t in self.manifest.tensors]

    def layout(self, name: str) -> TensorLayout:
        """Where tensor ``name`` lies in the blob (``tensor_layout``; cached)."""
        got = self._layouts.get(name)
        if got is None:
            got = self._layouts[name] = tensor_layout(self.manifest, name)
        return got

    def raw(self, name: str) -> Any:
        """``uint8`` view of one tensor's bytes (``gate_up_proj`` included, see
        ``tensor_layout``)."""
        t = self.layout(name)
        return self.blob[t.offset : t.offset + t.nbytes]

    def tensor(self, name: str) -> Any:
        """The tensor as an array of its shape; BF16 and FP8 come as raw integer bits. The
        same view object each time (don't reshape it in place)."""
        got = self._views.get(name)
        if got is None:
            t = self.layout(name)
            got = self._views[name] = self.raw(name).view(NUMPY_DTYPES[t.dtype]).reshape(t.shape)
        return got

    def swiglu_weights(self) -> tuple[Any, Any, Any]:
        """The expert's SwiGLU weights as BF16 bits ``uint16``: gate ``[I, H]``, up ``[I, H]``,
        down ``[H, I]``. Per-expert tensors as they are; a fused ``gate_up_proj`` with its
        ``down_proj`` split into halves, gate first: ``[2I, H]`` and ``[H, I]``
        (transformers 5's fused save) as contiguous views, ``[H, 2I]`` and ``[I, H]``
        (Llama-4's orientation) as transposed views. ValueError naming the blob's tensors
        for any other expert (biases: gpt-oss's, see :meth:`clamped_swiglu_weights`; not
        BF16)."""
        names = set(self.names)
        if "gate_proj" in names:
            weights = (self.tensor("gate_proj"), self.tensor("up_proj"),
                       self.tensor("down_proj"))
        elif ({"gate_up_proj", "down_proj"} <= names
              and not any(n.endswith("_bias") for n in names)):
            fused, down = self.tensor("gate_up_proj"), self.tensor("down_proj")
            (a, b), (c, d) = fused.shape, down.shape
            if a == 2 * d and b == c:
                weights = (fused[:d], fused[d:], down)
            elif b == 2 * c and a == d:
                weights = (fused[:, :c].T, fused[:, c:].T, down.T)
            else:
                raise ValueError(f"{self.key}: gate_up_proj {list(fused.shape)} and down_proj "
                                 f"{list(down.shape)} are not [2I, H] and [H, I], nor "
                                 "[H, 2I] and [I, H]")
        else:
            raise ValueError(f"{self.key}: not a SwiGLU expert without biases (its tensors: "
                             f"{sorted(names)})")
        self._check_dtypes(names, {"BF16"})
        return weights

    def clamped_swiglu_weights(self) -> ClampedSwiGLU:
        """gpt-oss's expert (``activation`` CLAMPED_SWIGLU) widened to float32 (a copy): BF16
        ``gate_up_proj`` ``[H, 2I]`` with gate and up interleaved (even columns gate) and
        ``down_proj`` ``[I, H]``, as transformers' ``GptOssExperts`` keeps them, or MXFP4 as
        gpt-oss ships it (``_blocks`` ``[2I, H/32, 16]`` and ``[H, I/32, 16]`` with their
        ``_scales``: rows interleaved likewise), each with its BF16 bias. ValueError naming
        what the blob holds for any other expert."""
        m = self.manifest
        names = set(self.names)
        biases = {"gate_up_proj_bias", "down_proj_bias"}
        bf16 = {"gate_up_proj", "down_proj"} | biases
        mxfp4 = {f"{p}_{part}" for p in ("gate_up_proj", "down_proj")
                 for part in ("blocks", "scales")} | biases
        if m.activation != pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU or names not in (bf16, mxfp4):
            raise ValueError(f"{self.key}: not a clamped-SwiGLU (gpt-oss) expert with "
                             f"{sorted(bf16)} or {sorted(mxfp4)} (its activation "
                             f"{pb.ExpertActivation.Name(m.activation)}, tensors {sorted(names)})")
        self._check_dtypes(biases, {"BF16"})
        bias = reference.bf16_to_f32(self.tensor("gate_up_proj_bias"))
        down_bias = reference.bf16_to_f32(self.tensor("down_proj_bias"))
        if names == bf16:
            self._check_dtypes({"gate_up_proj", "down_proj"}, {"BF16"})
            fused = reference.bf16_to_f32(self.tensor("gate_up_proj")).T  # [2I, H]
            down = reference.bf16_to_f32(self.tensor("down_proj")).T  # [H, I]
        else:
            self._check_dtypes(mxfp4 - biases, {"U8"})
            fused, down = (gpt_oss.mxfp4_to_f32(self.tensor(f"{p}_blocks"),
                                                  self.tensor(f"{p}_scales"))
                           for p in ("gate_up_proj", "down_proj"))
        (two_i, h), (h2, i) = fused.shape, down.shape
        if two_i != 2 * i or h2 != h or bias.shape != (two_i,) or down_bias.shape != (h,):
            raise ValueError(f"{self.key}: gate_up {list(fused.shape)}, its bias "
                             f"{list(bias.shape)}, down {list(down.shape)} and its bias "
                             f"{list(down_bias.shape)} are not [2I, H], [2I], [H, I], [H]")
        return ClampedSwiGLU(fused[0::2], fused[1::2], down, bias[0::2], bias[1::2],
                             down_bias, float(m.swiglu_alpha), float(m.swiglu_limit))

    def _check_dtypes(self, names: set[str], allowed: set[str]) -> None:
        kinds = {self.layout(n).dtype for n in names if not n.endswith("_scale_inv")}
        if not kinds <= allowed:
            raise ValueError(f"{self.key}: the worker computes {sorted(allowed)} tensors "
                             f"here, this expert holds {sorted(kinds)}")

    def torch(self, name: str) -> Any:
        """The tensor as a torch tensor of its real dtype, sharing memory through DLPack (on
        the CPU reference device too)."""
        import torch

        t = self.layout(name)
        raw = torch.from_dlpack(self.raw(name))
        return raw.view(getattr(torch, TORCH_DTYPES[t.dtype])).reshape(t.shape)
