"""Where an offloaded transformers MoE layer spends the host's time: ``generate()`` with
``offload_experts`` (issue 20's model: a transformers MoE model at a real architecture's expert
shapes, random weights), each part of a layer's forward timed on the host.

The parts are the functions a layer's forward calls (``host_client.integrations``): the
routing's copy to the host (``routed_experts``), the batch's post and grants
(``AgentClient.acquire_batch``), the routing report (``report_visit``), the stream waits
(``enqueue_wait``, each) or the host's (``wait_all``), the experts module's own forward on the
slot views (``_compute``: its kernels' launch on a GPU, their run on the CPU), the host's wait
for them (``_synchronize``), the stream waits' verdicts (``StreamWait.check``, each), the
release, and the layer as a whole (``_Layer.__call__``). Each is wrapped with a wall-clock timer
for the timed run only (a wrapper costs ~1 us a call). Baseline in the same run: the resident
model's tokens per second (the same implementation), so ``per_layer_excess_us`` (the offload's
time per token beyond the resident's, per MoE layer) says how much the parts must explain, and
the resident experts module's forward timed the same way in a run of its own
(``resident_parts``), so ``_compute`` is read against what the resident layer spends on it.
And a ceiling (``ceiling_tokens_per_s``): the offloaded model once more, each layer computing
on the pool's views straight from a device table of the slots its experts held (recorded in
the offload run), with no routing copy, no agent and no wait: what any design that keeps the
slot pool (the GPU asking for its own experts) could reach. The timed run repeats the fill
run's prompt (``timed_generate``'s fixed ids), so its experts were routed before and mostly
sit in the pool (``hit_rate``: 0.97-1.00 at 50 %): the parts are the host path of a warm
layer, not a decode whose misses wait for bytes (``bench/transformers_decode.py`` measures
that). And the resident model once
more, a copy loaded before the agent started and run while it (its data-plane loop, its
DMA-engine process) is up (``resident_beside_agent_*``): the host's own slowdown from those
processes, which the offloaded run pays too.

    python bench/layer_parts.py --device cuda [--cache 0.5] [--new-tokens 64] [--shrink 1]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, keep_off_agent_cpus, median, write
from bench.transformers_decode import _cuda, build, load, timed_generate


def _wrap(times: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - t)
    return timed


@contextlib.contextmanager
def _patched(replacements: list[tuple[Any, str, Callable[[Any], Any]]]) -> Iterator[None]:
    """While open, each ``(owner, name, make)``: the owner's attribute (or, for a dict, its
    key) replaced by ``make(what was there)``; a static method stays static."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, make in replacements:
            if isinstance(owner, dict):
                saved.append((owner, name, owner[name]))
                owner[name] = make(owner[name])
                continue
            raw = inspect.getattr_static(owner, name)
            saved.append((owner, name, raw))
            made = make(getattr(owner, name))
            setattr(owner, name, staticmethod(made) if isinstance(raw, staticmethod) else made)
        yield
    finally:
        for owner, name, raw in reversed(saved):
            if isinstance(owner, dict):
                owner[name] = raw
            else:
                setattr(owner, name, raw)


def _timed(times: dict[str, list[float]], parts: list[tuple[Any, str, str]]
           ) -> contextlib.AbstractContextManager[None]:
    """While open, each ``(owner, attribute, name)`` of ``parts`` is timed into ``times``
    under ``name`` (module or class attributes, so every caller sees them)."""
    return _patched([(owner, attr, functools.partial(_wrap, times, name))
                     for owner, attr, name in parts])


def _grouped_mm() -> dict[str, Any]:
    """transformers' experts functions by name: ``grouped_mm`` is the experts module's forward
    less its dispatch (and, offloaded, less the views' swap and the slot numbers)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS._global_mapping


def _layer_parts() -> list[tuple[Any, str, str]]:
    """Each part of an offloaded layer's forward."""
    import host_client.integrations.layer_fetch as lf
    import host_client.integrations.transformers as ht
    from host_client.client import AgentClient
    from host_client.handles import AcquireHandle
    from host_client.slot_checks import StreamWait

    return [(ht, "routed_experts", "routed_experts"),
            (AgentClient, "acquire_batch", "acquire_batch"),
            (AgentClient, "report_visit", "report_visit"),
            (AgentClient, "wait_all", "wait_all"),
            (lf, "_stream_waits", "_stream_waits (the enqueue_waits, with the stream's view)"),
            (AcquireHandle, "enqueue_wait", "enqueue_wait (each)"),
            (lf, "_slot_numbers", "_slot_numbers"),
            (ht._Layer, "_compute", "_compute"),
            (ht._Layer, "_slots_on", "_slots_on (in _compute)"),
            (_grouped_mm(), "grouped_mm", "grouped_mm function (in _compute)"),
            (lf, "_synchronize", "_synchronize"),
            (StreamWait, "check", "StreamWait.check (each)"),
            (AgentClient, "release_batch", "release_batch"),
            (lf, "acquire_layer", "acquire_layer (all of the above before _compute)"),
            (ht._Layer, "__call__", "_Layer.__call__ (the layer)")]


def _timed_resident(model: Any, new: int) -> dict[str, list[float]]:
    """The resident experts modules' forward, each call timed, over one ``generate``."""
    from host_client.integrations.moe_modules import experts_modules

    times: dict[str, list[float]] = {}
    owner = type(next(module for _, module in experts_modules(model)))
    with _timed(times, [(owner, "forward", "experts forward (resident)"),
                        (_grouped_mm(), "grouped_mm", "grouped_mm function (resident)")]):
        timed_generate(model, 1, 16, new, None)
    return times


def _recording_slots(tables: dict[int, Any]) -> contextlib.AbstractContextManager[None]:
    """While open, each offloaded layer's slot numbers, as it sends them to the device, are
    kept per layer (expert -> slot in the pool, ``int64[num_experts + 1]``, -1 for an expert
    never routed, merged over the forwards)."""
    import numpy as np

    import host_client.integrations.transformers as ht

    def recording(slots_on: Callable[..., Any]) -> Callable[..., Any]:
        def record(self: Any, window: Any, device: Any, row: Any, routed: list[int]) -> Any:
            table = tables.setdefault(self.layer, np.full(row.shape, -1, np.int64))
            table[routed] = row[routed] + window.first
            return slots_on(self, window, device, row, routed)
        return record

    return _patched([(ht._Layer, "_slots_on", recording)])


def _ceiling(model: Any, off: Any, tables: dict[int, Any], new: int) -> tuple[float, Any]:
    """(tokens per second, output ids) of ``generate`` with each offloaded layer computing on
    the pool's views straight from a device table of the slots its experts held in the
    offload run: no routing copy, nothing asked of the agent, nothing waited on. The ceiling of
    any design that keeps the slot pool and its views (the GPU asking for its own experts)."""
    import numpy as np
    import torch

    import host_client.integrations.transformers as ht

    windows, on_device = {}, {}
    for layer, table in tables.items():
        forward, held = off.layers[layer].forward, table[table >= 0]
        home = forward.home
        if home is not None and home.holds(held).all():
            window = home
        else:
            window, = forward.windows  # a pool of one window (MAX_GROUPS slots at most)
        windows[layer] = window
        on_device[layer] = torch.from_numpy(
            np.where(table >= 0, table - window.first, window.count)).to(model.device)

    def direct(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        return self._forward(windows[self.layer], False, hidden_states,
                             on_device[self.layer][top_k_index], top_k_weights)

    with _patched([(ht._Layer, "__call__", lambda _: direct)]):
        return timed_generate(model, 1, 16, new, None)


def _table(times: dict[str, list[float]], calls: int) -> dict[str, dict[str, float]]:
    return {name: {"calls_per_layer": len(v) / calls, "p50_us": median(v) * 1e6,
                   "per_layer_us": sum(v) / calls * 1e6} for name, v in times.items()}


def run(device: str, cache: float, new: int, shrink: int, layers: int,
        layer_homes: bool = False) -> dict[str, Any]:
    from host_client import AgentClient, CpuReferenceDevice
    from host_client.integrations.transformers import offload_experts
    from host_client.launcher import AgentProcess

    torch_device = "cuda" if device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = build("qwen3-30b-a3b", layers, shrink, Path(tmp) / "model")
        model = load(path, torch_device)
        model.set_experts_implementation("grouped_mm")
        timed_generate(model, 1, 16, new, None)  # warm-up
        resident, _ = timed_generate(model, 1, 16, new, None)
        resident_times = _timed_resident(model, new)
        twin = load(path, torch_device)  # resident beside the agent, later
        twin.set_experts_implementation("grouped_mm")
        experts_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                           if ".experts." in n)
        arena = f'[arena]\nbytes = "{int(experts_bytes * 1.1) + (64 << 20)}"\n'
        with AgentProcess(arena) as agent, AgentClient(agent.address, rpc_timeout=300) as client:
            made = CpuReferenceDevice() if device == "cpu" else _cuda()
            off = offload_experts(model, client, path, made, cache=cache, delivery="engine",
                                  layer_homes=layer_homes)
            timed_generate(model, 1, 16, new, None)  # the arena and the pool filled
            times: dict[str, list[float]] = {}
            tables: dict[int, Any] = {}
            hits0, acquired0 = off.hits, off.experts_acquired
            with _recording_slots(tables), _timed(times, _layer_parts()):
                offload, offload_ids = timed_generate(model, 1, 16, new, None)
                off.settle()
            ceiling, ceiling_ids = _ceiling(model, off, tables, new)
            beside, _ = timed_generate(twin, 1, 16, new, None)
            beside_times = _timed_resident(twin, new)
    calls = len(times["_Layer.__call__ (the layer)"])
    return {"arch": "qwen3-30b-a3b", "layers": layers, "shrink": shrink, "cache": cache,
            "layer_homes": layer_homes,
            "new_tokens": new, "resident_tokens_per_s": resident,
            "offload_tokens_per_s": offload,
            "ceiling_tokens_per_s": ceiling,
            "ceiling_outputs_equal": bool((ceiling_ids == offload_ids).all()),
            "resident_beside_agent_tokens_per_s": beside,
            "per_layer_excess_us": (1 / offload - 1 / resident) / layers * 1e6,
            "hit_rate": (off.hits - hits0) / max(1, off.experts_acquired - acquired0),
            "layer_calls": calls, "parts": _table(times, calls),
            "resident_parts": _table(resident_times, calls),
            "resident_beside_agent_parts": _table(beside_times, calls)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--cache", type=float, default=0.5, help="GPU expert-cache fraction")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--shrink", type=int, default=0,
                    help="divide the sizes (default: 1 on a GPU, 4 on the CPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layer-homes", action="store_true",
                    help="the pool cut into one home per MoE layer (offload_experts' layer_homes)")
    a = ap.parse_args()
    keep_off_agent_cpus()
    if not 0 < a.cache <= 1 or a.new_tokens < 1 or a.shrink < 0 or a.layers < 1:
        ap.error("--cache in (0, 1], --new-tokens and --layers >= 1, --shrink >= 0")
    shrink = a.shrink or (1 if a.device == "cuda" else 4)
    r = run(a.device, a.cache, a.new_tokens, shrink, a.layers, a.layer_homes)
    print(f"resident {r['resident_tokens_per_s']:.1f} tok/s, offload "
          f"{r['offload_tokens_per_s']:.1f} (hit rate {r['hit_rate']:.2f}): "
          f"{r['per_layer_excess_us']:.0f} us per MoE layer beyond the resident run; "
          f"the pool's views from a device table, nothing asked: "
          f"{r['ceiling_tokens_per_s']:.1f} tok/s (outputs equal the offload's: "
          f"{r['ceiling_outputs_equal']}); a resident copy beside the running agent: "
          f"{r['resident_beside_agent_tokens_per_s']:.1f} tok/s")
    for title, parts in (("offloaded", r["parts"]), ("resident", r["resident_parts"]),
                         ("resident beside the agent", r["resident_beside_agent_parts"])):
        print(title)
        for name, p in parts.items():
            print(f"  {name:52s} x{p['calls_per_layer']:4.1f}  p50 {p['p50_us']:8.1f} us  "
                  f"per layer {p['per_layer_us']:8.1f} us")
    write("layer-parts", envelope("layer-parts", r, device=a.device),
          f"-{a.device}" + ("-homes" if a.layer_homes else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
