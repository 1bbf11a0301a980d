"""Hugging Face transformers models served through the agent: :func:`offload_experts`.

transformers 5 gives every routed-MoE family one experts module per layer: its weights are
stacked parameters (``gate_up_proj`` ``[E, 2I, H]`` or ``[E, H, 2I]``, ``down_proj``, optional
biases) and its forward takes ``(hidden_states, top_k_index, top_k_weights)``. The slot pool
lays experts out at a fixed stride, so each of those parameters has a zero-copy view over the
whole pool, ``[slots, ...]``, with the same per-expert shape. Offloading drops the module's
expert parameters; on each forward the layer acquires its routed experts through the agent (one
batch), points the parameters at the pool views, renumbers ``top_k_index`` from expert ids to
slot numbers and runs the module's own forward (whichever experts implementation the model is
configured with: same math as the resident model), then releases the experts.

Llama-4 is the exception: its experts module takes every expert's copy of the input, already
scaled by the router (``[E * T, H]``), and computes all ``E`` experts (the non-routed ones on
zero rows). Its MoE block's forward is replaced instead (:class:`_ScaledInputBlock`): the
router as the model runs it, the routed experts acquired, each computed by the module's own
forward on its slot's view, the others left at the zeros they would have produced, and the sum
and shared expert as the model does them (same math, so the same logits).

Which layer a module serves comes from its name (``...layers.{L}...``) and must be one of the
checkpoint's MoE layers; which tensor of a blob backs which parameter comes from the blob's
roles: the module's parameter names, or ``gate_proj`` + ``up_proj`` lying side by side (a
per-expert checkpoint) for ``gate_up_proj``. Finding the experts modules and loading a model
without them: ``host_client.integrations.moe_modules`` (its names are this module's too).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpu_offload.keys import ExpertKey
from host_client.client import AgentClient
from host_client.devices import Device
from host_client.integrations.layer_fetch import ExpertOffload, routed_experts, through_agent
from host_client.integrations.moe_modules import (
    EXPERT_PARAMETERS,
    OffloadError,
    expert_parameters,
    experts_modules,
    load_without_experts,
    scaled_input_blocks,
)
from host_client.integrations.pool_views import PoolViews, Window, pool_views
from host_client.memory import SlotPoolSpec
from host_client.registration import AttachedDevice

__all__ = ["EXPERT_PARAMETERS", "ExpertOffload", "OffloadError", "expert_parameters",
           "experts_modules", "load_without_experts", "offload_experts", "scaled_input_blocks"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class _NextRouter:
    """The router of the MoE layer decode reaches next, for pre-gating: its ``weight``
    ``[E, H]`` (and ``bias`` ``[E]`` or None) applied to this layer's input predicts the
    next layer's choice; ``predicted`` holds the last prediction, to count how it did."""

    layer: int
    weight: Any
    bias: Any
    predicted: set[int] = field(default_factory=set)


class _Layer:
    """One MoE layer's forward through the agent (bound to its experts module); with a
    ``next_router``, it prefetches the experts that router would choose for this layer's
    tokens while its own land (pre-gating: the residual stream changes little between
    layers, so the next layer's router on this layer's input predicts its choice)."""

    def __init__(self, offload: ExpertOffload, layer: int, module: Any, views: PoolViews
                 ) -> None:
        self.offload, self.layer, self.module, self.views = offload, layer, module, views
        self.forward = type(module).forward
        self.num_experts = int(module.num_experts)
        self.next_router: _NextRouter | None = None
        self.previous: _NextRouter | None = None
        """The layer before's prediction of this one (counted when this one routes)."""
        self.windows = views.windows()
        """The pool in runs of at most ``MAX_GROUPS`` slots (one, where it fits), each computed
        by a forward of its own."""
        self.home = views.home(layer)
        """The pool's run of slots kept for this layer (None: none), computed over alone
        whenever the routed experts all lie in it."""
        self._slots: dict[tuple[int, int], tuple[Any, np.ndarray]] = {}
        """Per window (its first slot and size): the slot numbers on the experts' device
        (``int64[num_experts + 1]``) and the host row they were copied from."""

    def _prefetch_next(self, hidden_states: Any, top_k: int) -> None:
        import torch

        nxt = self.next_router
        assert nxt is not None
        with torch.no_grad():
            logits = hidden_states.reshape(-1, nxt.weight.shape[1]) @ nxt.weight.T
            if nxt.bias is not None:
                logits = logits + nxt.bias
            chosen = torch.unique(logits.topk(top_k, dim=-1).indices).tolist()
        nxt.predicted = {e for e in chosen if 0 <= e < self.num_experts}
        off = self.offload
        keys = [ExpertKey(off.model, nxt.layer, e) for e in sorted(nxt.predicted)]
        off.prefetched += off.client.prefetch(off.device, keys, wait=False)

    def __call__(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        off = self.offload
        routed = routed_experts(top_k_index, self.num_experts)
        if self.previous is not None:
            off.prefetch_used += len(self.previous.predicted & set(routed))
            self.previous.predicted = set()
        meanwhile = None if self.next_router is None else (
            lambda: self._prefetch_next(hidden_states, int(top_k_index.shape[-1])))
        return through_agent(off, self.layer, routed, self.views, self.num_experts,
                              lambda slot_of: self._compute(hidden_states, slot_of, list(routed),
                                                            top_k_index, top_k_weights),
                              meanwhile)

    def _slots_on(self, window: Window, device: Any, row: np.ndarray, routed: list[int]
                  ) -> Any:
        """``row`` (the window's slot numbers, ``int64[num_experts + 1]``) on ``device``,
        copied only when a routed expert's entry differs from the row already there (the
        layer's kernels read the routed experts' entries only): with the experts in the slots
        they held last time, no copy. A copy goes to a new tensor (kernels still queued read
        the old one), from page-locked memory behind the stream's waits."""
        import torch

        kept = self._slots.get((window.first, window.count))
        if kept is not None:
            on_device, copied = kept
            if on_device.device == device and np.array_equal(copied[routed], row[routed]):
                return on_device
        table = torch.from_numpy(row)
        if device.type == "cuda":
            table = table.pin_memory()
        on_device = self._slots[window.first, window.count] = (
            table.to(device, non_blocking=True), row)
        return on_device[0]

    def _compute(self, hidden_states: Any, slot_of: np.ndarray, routed: list[int],
                 top_k_index: Any,
                 top_k_weights: Any) -> Any:
        """The experts module's own forward on the pool's views, ``top_k_index`` renumbered
        to slot numbers: over the layer's home alone when the routed experts all lie in it;
        else, on a pool of more than ``MAX_GROUPS`` slots, one forward per window that holds a
        routed expert (the others' experts renumbered to the window's size: an expert-parallel
        sentinel, which the experts implementations leave out), summed."""
        home = self.home
        at_home = home is not None and bool(home.holds(slot_of[routed]).all())
        windows = [home] if at_home else self.windows
        windowed = not at_home and len(self.windows) > 1
        rows = []
        for window in windows:
            inside = window.holds(slot_of)
            if inside[routed].any() or (window is windows[-1] and not rows):
                rows.append((window, np.where(inside, slot_of - window.first, window.count)))
        out = None
        for window, row in rows:
            part = self._forward(window, windowed, hidden_states,
                                 self._slots_on(window, top_k_index.device, row,
                                                routed)[top_k_index], top_k_weights)
            out = part if out is None else out.add_(part)
        return out

    def _forward(self, window: Window, windowed: bool, hidden_states: Any, slots: Any,
                 top_k_weights: Any) -> Any:
        """The module's forward with its parameters pointing at ``window``'s views (with
        ``windowed``, experts outside it skipped as expert-parallel sentinels)."""
        module = self.module
        sentinels = getattr(module, "_is_expert_parallel", False)
        try:
            for param, view in window.tensors.items():
                setattr(module, param, view)
            module.num_experts = window.count
            if windowed:
                module._is_expert_parallel = True
            return self.forward(module, hidden_states, slots, top_k_weights)
        finally:
            module.num_experts = self.num_experts
            if windowed:
                module._is_expert_parallel = sentinels
            for param in window.tensors:
                setattr(module, param, None)


class _ScaledInputBlock:
    """Llama-4's MoE block forward through the agent (bound to the block): the model's router,
    the routed experts each run by the experts module's own forward on its slot's views (one
    expert's ``[1, T, H]`` input), zeros for the rest (what the model computes for them: their
    input rows are zero), then the model's sum over experts and its shared expert."""

    def __init__(self, offload: ExpertOffload, layer: int, block: Any, views: PoolViews
                 ) -> None:
        self.offload, self.layer, self.block, self.views = offload, layer, block, views
        self.experts = block.experts
        self.experts_forward = type(block.experts).forward
        self.num_experts = int(block.num_experts)

    def __call__(self, hidden_states: Any) -> tuple[Any, Any]:
        import torch

        block = self.block
        tokens = hidden_states.reshape(-1, block.hidden_dim)
        scores, logits = block.router(tokens)  # [T, E]; 0 outside each token's top k
        routed = routed_experts(torch.topk(logits, block.top_k, dim=1).indices, self.num_experts)
        out = through_agent(self.offload, self.layer, routed, self.views, self.num_experts,
                             lambda slot_of: self._compute(tokens, scores, routed, slot_of))
        return out, logits

    def _compute(self, tokens: Any, scores: Any, routed: dict[int, int], slot_of: np.ndarray
                 ) -> Any:
        """The block's output ``[T, H]`` for ``tokens`` ``[T, H]`` and router ``scores``
        ``[T, E]``, each routed expert computed on its slot's views."""
        import torch

        block, experts = self.block, self.experts
        try:
            scaled = tokens.repeat(self.num_experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
            scaled = scaled.view(self.num_experts, -1, block.hidden_dim)
            per_expert = torch.zeros_like(scaled)
            for e in routed:
                s = int(slot_of[e])
                for param, view in self.views.tensors.items():
                    setattr(experts, param, view[s:s + 1])
                per_expert[e] = self.experts_forward(experts, scaled[e])
            out = block.shared_expert(tokens)
            return out.add_(per_expert.sum(dim=0))
        finally:
            for param in self.views.tensors:
                setattr(experts, param, None)


def offload_experts(model: Any, client: AgentClient, checkpoint: str | Path,
                    device: Device | AttachedDevice, cache: float | int = 0.25,
                    name: str = "", delivery: str = "pull", prefetch: bool = False,
                    report_routing: bool = True, gpu_waits: bool = True,
                    layer_homes: bool = False) -> ExpertOffload:
    """Serve ``model``'s routed experts through the agent.

    Args:
        model: a transformers 5 MoE model (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3,
            gpt-oss, GraniteMoE, PhiMoE, Llama-4...); its experts' parameters are dropped
            (they may be on the meta device), everything else stays where it is.
        client: a connected :class:`AgentClient`.
        checkpoint: the model's checkpoint directory, loaded into the agent here.
        device: where the experts are delivered: a :class:`Device` (registered here with one
            slot pool) or an already registered :class:`AttachedDevice` with one pool.
        cache: the pool's size: a fraction of all routed experts, or a number of slots; never
            fewer than one layer's experts (a prefill may route to all of them).
        name: the agent's name for the checkpoint (default: the directory's name).
        delivery: how a :class:`Device` registered here is filled: ``"pull"`` (its own
            consumer) or ``"engine"`` (the agent's DMA-engine process; see
            :meth:`AgentClient.register_device`).
        prefetch: pre-gating: each MoE layer, once its own experts are granted, applies the
            next MoE layer's router to its input and prefetches the experts it would choose
            (a hint: nothing is held, a refusal is only counted). ``prefetched`` and
            ``prefetch_used`` of the result say how it did. Layers whose block has no
            ``gate`` or ``router`` with a ``weight`` ``[E, H]`` prefetch nothing.
        report_routing: each MoE layer reports what it chose (experts and tokens) to the
            agent through the device's data-plane channel once its batch is granted
            (``report_visit``: no gRPC call, no thread, no wake; the agent folds it at its
            next wake): the agent's routing statistics, which its cache policies (the arena's and
            the slot pool's), predictor and placement planner learn from. On by default: the
            slot pool's learned-reuse policy keeps more of a decode resident with it (the
            Mixtral trace through an agent at a quarter of the experts: 0.362 against 0.343
            without, docs/PERFORMANCE-NOTES.md); ``False`` saves one ROUTE post per layer.

        gpu_waits: on a CUDA device, each layer waits for its experts' bytes on the GPU:
            the host waits only for the grants, the experts code is launched behind stream
            waits while the experts land, and the host waits once, for the layer's result;
            a layer whose delivery fails its check there is acquired again, the host waiting,
            and computed again (``ExpertOffload.stream_retries``). Off: the host waits for
            every expert before the launch. On by default: on an H100 (two interleaved rounds
            of ``bench/transformers_decode.py``, Qwen3 shapes, batch 1) it took 10 and 25 %
            caches from 66 and 70 to 87 and 97 tok/s; at 50 %, where a layer seldom misses,
            it read 93 against 110 (docs/PERFORMANCE-NOTES.md). No effect off a GPU.

        layer_homes: a :class:`Device` registered here gets a pool cut into one home per MoE
            layer (``SlotPoolSpec.home_layers``, its size rounded up to a multiple of the
            layers): a layer's misses take slots of its home while it has room, so its forward
            computes over its home's slots alone, one group per home slot in transformers'
            grouped GEMM instead of one per pool slot (on the 2-core VM's torch a group costs
            ~0.9 us whether tokens chose it or not). A layer routing to more experts than its
            home holds (a prefill) takes other homes' idle slots and computes over the whole
            pool, as without homes. Off by default: on the 2-core VM (``bench/layer_parts.py``,
            Qwen3 shapes) the layers' compute got faster than the resident model's, but a home
            is a fixed share, and the cache hit less (0.97 against 1.00 at 50 %), so decode was
            no faster; replaying the Mixtral trace a cache cut per layer hits as often as one
            shared (docs/PERFORMANCE-NOTES.md, forty-seventh session). Not yet measured on a
            GPU.

    Returns:
        The :class:`ExpertOffload`; ``generate()`` and ``forward`` run unchanged.
    """
    if isinstance(cache, bool) or not (
            (isinstance(cache, int) and cache > 0)
            or (isinstance(cache, float) and math.isfinite(cache) and 0 < cache <= 1)):
        raise ValueError(f"cache: a fraction in (0, 1] or a positive number of slots, "
                         f"got {cache!r}")
    info = client.load_model(str(checkpoint), name)
    per_layer, layers = info.experts_per_layer, list(info.moe_layers)
    if isinstance(device, AttachedDevice):
        dev = device
    else:
        total = per_layer * len(layers)
        slots = cache if isinstance(cache, int) else round(cache * total)
        slots = max(per_layer, min(slots, total))
        homes = tuple(layers) if layer_homes else ()
        if homes:
            slots = math.ceil(slots / len(homes)) * len(homes)
        dev = client.register_device(device, [SlotPoolSpec(info.expert_bytes, slots, homes)],
                                     delivery=delivery)
    offload = ExpertOffload(client, info.model, dev, report_routing=report_routing,
                            gpu_waits=gpu_waits)
    blocks = dict(scaled_input_blocks(model))
    routed: dict[int, tuple[_Layer, str]] = {}
    """MoE layer -> its ``_Layer`` forward and its experts module's name."""
    for qualified, module in [*experts_modules(model),
                              *((name, block.experts) for name, block in blocks.items())]:
        m = _LAYER.search(qualified)
        layer = int(m[1]) if m else -1
        if layer not in layers:
            raise OffloadError(f"{qualified}: no MoE layer {layer} in checkpoint {checkpoint} "
                               f"(its MoE layers: {layers})")
        if int(module.num_experts) != per_layer:
            raise OffloadError(f"{qualified}: {module.num_experts} experts, the checkpoint "
                               f"has {per_layer} per layer")
        wanted = expert_parameters(module)
        views = pool_views(dev, client.manifest(ExpertKey(info.model, layer, 0)), wanted)
        for p in wanted:
            module._parameters.pop(p, None)
            setattr(module, p, None)
        offload.layers[layer] = module
        if qualified in blocks:
            blocks[qualified].forward = _ScaledInputBlock(offload, layer, blocks[qualified],
                                                          views)
        else:
            module.forward = _Layer(offload, layer, module, views)
            routed[layer] = (module.forward, qualified)
    if not offload.layers:
        raise OffloadError("the model has no transformers 5 experts module (stacked expert "
                           "parameters and a (hidden_states, top_k_index, top_k_weights) "
                           "forward)")
    missing = sorted(set(layers) - set(offload.layers))
    if missing:
        raise OffloadError(f"the model has no experts module for MoE layers {missing} of "
                           f"checkpoint {checkpoint}")
    if prefetch:
        _link_next_routers(model, sorted(offload.layers), routed)
    return offload


def _router(model: Any, experts_name: str) -> tuple[Any, Any] | None:
    """(weight ``[E, H]``, bias or None) of the router beside the experts module named
    ``experts_name`` (its block's ``gate`` or ``router``); None where there is none."""
    block = model.get_submodule(experts_name.rsplit(".", 1)[0]) if "." in experts_name \
        else model
    for attr in ("gate", "router"):
        router = getattr(block, attr, None)
        weight = getattr(router, "weight", None)
        if weight is not None and getattr(weight, "ndim", 0) == 2:
            bias = getattr(router, "bias", None)
            return weight, bias if getattr(bias, "ndim", 0) == 1 else None
    return None


def _link_next_routers(model: Any, order: list[int],
                       routed: dict[int, tuple[_Layer, str]]) -> None:
    """Give each ``_Layer`` the router of the MoE layer after it in ``order`` (the last
    layer's is the first's: the next token), for pre-gated prefetch."""
    for i, layer in enumerate(order):
        nxt = order[(i + 1) % len(order)]
        if layer not in routed or nxt not in routed:
            continue
        there, name = routed[nxt]
        router = _router(model, name)
        if router is not None:
            routed[layer][0].next_router = there.previous = _NextRouter(nxt, *router)
