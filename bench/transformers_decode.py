"""transformers ``generate()`` with the experts served by the agent (issue 20's benchmark).

A transformers MoE model with a real architecture's full expert shapes and random weights,
layers reduced to fit the machine, saved with ``save_pretrained`` and loaded into an agent. In
one run, tokens per second of ``generate()`` at batch 1 and 8 for:

- ``resident``: every expert in device memory, with the fastest experts implementation
  transformers offers here (``batched_mm``, ``grouped_mm`` and ``eager`` are each timed; one
  that runs out of device memory, as ``batched_mm`` does for Mixtral at batch 8 on 80 GB, is
  recorded unavailable);
- ``offload``: ``offload_experts`` at each GPU expert-cache fraction (routing from the model's
  own router), its outputs compared with the resident run's; each fraction first runs once
  untimed, so the arena holds the experts (the timed runs measure GPU-pool misses served from
  host DRAM, not first reads of the checkpoint);
- ``accelerate``: the expert modules left on the CPU through ``device_map`` (accelerate moves
  them for each forward), where accelerate is installed: from pageable memory, as
  ``from_pretrained(device_map=...)`` leaves them, and from pinned memory
  (``accelerate_pinned``: the expert parameters pinned, then ``dispatch_model``), the faster of
  the two and the one issue 20's target compares with;
- ``bound``: the serial bound 1 / (1/resident + missed bytes per token / pinned host-to-device
  rate), the pinned rate measured in the same run.

    python bench/transformers_decode.py --device cuda [--arch qwen3-30b-a3b] [--layers 4]
        [--trace ../shared/traces/olmoe-1b-7b-layer0-gsm8k.jsonl --arch olmoe-1b-7b]

``--trace`` replays a real routing trace (each experts module's router choices replaced by the
trace's, the same for every run), so the cache sees real locality instead of a random model's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    envelope,
    figure,
    host_to_device_rate,
    keep_off_agent_cpus,
    save_figure,
    trace_path,
    write,
)
from dpu_offload.cli_args import fraction, positive

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {  # real expert shapes, attention trimmed
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128)),
    "olmoe-1b-7b": ("OlmoeConfig", dict(
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
        num_attention_heads=16, num_key_value_heads=16)),
    "mixtral-8x7b": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8)),
}
IMPLEMENTATIONS = ("batched_mm", "grouped_mm", "eager")


def build(arch: str, layers: int, shrink: int, directory: Path) -> Path:
    """Save a random model of ``arch``'s shapes (sizes divided by ``shrink``, tests only)."""
    import torch
    import transformers

    cls, kw = ARCHS[arch]
    kw = dict(kw, num_hidden_layers=layers, vocab_size=4096)
    for key in ("hidden_size", "moe_intermediate_size", "intermediate_size"):
        if key in kw:
            kw[key] //= shrink
    if shrink > 1:
        kw.update(num_attention_heads=4, num_key_value_heads=4, head_dim=kw["hidden_size"] // 4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**kw)).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def load(path: Path, device: str) -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model.to(device).eval()


class TraceReplay:
    """Routing replayed from a trace (``../shared/traces`` format): a forward pre-hook on each
    experts module replaces the router's choices with the trace's, one trace step per token
    row, each module following one trace layer (cycled when the model has more layers).
    :meth:`rewind` before a run makes every run see the same routing."""

    def __init__(self, model: Any, trace: Path) -> None:
        from dpu_agent.routing.traces import read_trace
        from host_client.integrations.transformers import experts_modules

        by_layer: dict[int, list[tuple[int, ...]]] = {}
        for step in read_trace(trace):
            by_layer.setdefault(step.layer, []).append(step.experts)
        layers = sorted(by_layer)
        self.name = trace.stem
        self._cursor: dict[int, int] = {}
        for i, (_, module) in enumerate(experts_modules(model)):
            steps = by_layer[layers[i % len(layers)]]
            if max(max(s) for s in steps) >= int(module.num_experts):
                raise SystemExit(f"{trace}: experts up to {max(max(s) for s in steps)}, the "
                                 f"model has {module.num_experts} per layer")
            module.register_forward_pre_hook(self._hook(i, steps), with_kwargs=True)

    def rewind(self) -> None:
        self._cursor.clear()

    def _hook(self, i: int, steps: list[tuple[int, ...]]) -> Any:
        import torch

        def replace(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden, index, weights = args
            rows, k = index.shape
            at = self._cursor.get(i, 0)
            self._cursor[i] = at + rows
            chosen = [(steps[(at + r) % len(steps)] * k)[:k] for r in range(rows)]
            return (hidden, torch.tensor(chosen, dtype=index.dtype, device=index.device),
                    weights), kwargs

        return replace


def timed_generate(model: Any, batch: int, prompt: int, new: int,
                   replay: TraceReplay | None = None) -> tuple[float, Any]:
    """(tokens per second, output ids) of one greedy ``generate`` after a warm-up."""
    import torch

    ids = (torch.arange(batch * prompt, device=model.device).reshape(batch, prompt) * 7) % 4000
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        if replay is not None:
            replay.rewind()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t0), out.cpu()


def run(arch: str, layers: int, device: str, fractions: list[float], batches: list[int],
        prompt: int = 16, new: int = 16, shrink: int = 1,
        trace: Path | None = None, delivery: str = "engine", prefetch: bool = False,
        accelerate: bool = True, gpu_waits: bool = True) -> dict[str, Any]:
    import torch

    from host_client import AgentClient, CpuReferenceDevice
    from host_client.integrations.transformers import offload_experts
    from host_client.launcher import AgentProcess

    torch_device = "cuda" if device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = build(arch, layers, shrink, Path(tmp) / arch)
        model = load(path, torch_device)
        replay = TraceReplay(model, trace) if trace else None
        resident: dict[str, dict[int, float]] = {}
        outputs: dict[str, dict[int, Any]] = {}
        """Per implementation: on a GPU their roundings differ, so a run is compared with the
        resident run of the implementation it used."""
        for impl in IMPLEMENTATIONS:
            try:
                model.set_experts_implementation(impl)
            except (ValueError, ImportError) as exc:
                resident[impl] = {"unavailable": str(exc)[:200]}  # type: ignore[dict-item]
                continue
            resident[impl], outputs[impl] = {}, {}
            try:
                for b in batches:
                    resident[impl][b], outputs[impl][b] = timed_generate(model, b, prompt,
                                                                         new, replay)
            except torch.OutOfMemoryError as exc:  # batched_mm gathers weights per token
                resident[impl] = {  # type: ignore[dict-item]
                    "unavailable": f"out of device memory at batch {b}: {str(exc)[:160]}"}
                del outputs[impl]
                torch.cuda.empty_cache()
        best = max((i for i in resident if "unavailable" not in resident[i]),
                   key=lambda i: resident[i][batches[0]])
        expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                           if ".experts." in n) // (layers * _experts(model))
        del model
        rate = host_to_device_rate(device, 0, min(expert_bytes, 64 << 20))
        arena_bytes = int(expert_bytes * layers * _count(arch) * 1.1) + (64 << 20)
        arena = f'[arena]\nbytes = "{arena_bytes}"\n'
        runs = []
        with AgentProcess(arena) as agent:
            for fraction in fractions:
                model = load(path, torch_device)
                model.set_experts_implementation(best)
                replay = TraceReplay(model, trace) if trace else None
                with AgentClient(agent.address, rpc_timeout=300) as client:
                    made = CpuReferenceDevice() if device == "cpu" else _cuda()
                    off = offload_experts(model, client, path, made, cache=fraction,
                                          name=f"{arch}-{layers}", delivery=delivery,
                                          prefetch=prefetch, gpu_waits=gpu_waits)
                    row: dict[str, Any] = {"fraction": fraction, "tokens_per_s": {},
                                           "slots": sum(p.slot_count for p in
                                                        off.device.pools.values())}
                    # Untimed: the experts' first reads from the checkpoint fill the arena, so
                    # the timed runs measure misses of the GPU pool served from the arena.
                    timed_generate(model, batches[0], prompt, new, replay)
                    hits0, acquired0 = off.hits, off.experts_acquired
                    for b in batches:
                        before = off.experts_acquired - off.hits
                        tps, out = timed_generate(model, b, prompt, new, replay)
                        row.setdefault("outputs_equal", {})[b] = torch.equal(out,
                                                                             outputs[best][b])
                        missed = (off.experts_acquired - off.hits - before) * expert_bytes
                        row["tokens_per_s"][b] = tps
                        res = resident[best][b]
                        per_token = missed / (b * (new + 2))
                        row.setdefault("bound_tokens_per_s", {})[b] = \
                            1 / (1 / res + per_token / rate) if per_token else res
                        row.setdefault("missed_bytes_per_token", {})[b] = per_token
                    row["hit_rate"] = (off.hits - hits0) / max(1, off.experts_acquired
                                                               - acquired0)
                    # Pre-gated prefetch: the bound above counts only misses (conservative:
                    # prefetched bytes move too); what prefetch asked for and what was used.
                    row["prefetched"], row["prefetch_used"] = off.prefetched, off.prefetch_used
                    runs.append(row)
                del model
        skipped = {"unavailable": "not run (--no-accelerate)"}
        pageable = _accelerate(path, torch_device, batches, prompt, new, best, outputs[best],
                               trace, pinned=False) if accelerate else skipped
        pinned = _accelerate(path, torch_device, batches, prompt, new, best, outputs[best],
                             trace, pinned=True) if accelerate else skipped
    mismatched = [(r["fraction"], b) for r in runs for b, ok in r["outputs_equal"].items()
                  if not ok]
    return {"arch": arch, "layers": layers, "device": device, "shrink": shrink,
            "expert_bytes": expert_bytes, "pinned_rate_bytes_per_s": rate,
            "resident": resident, "resident_implementation": best, "offload": runs,
            "accelerate": pageable, "accelerate_pinned": pinned,
            "prompt_tokens": prompt, "new_tokens": new,
            "outputs_differ": mismatched, "routing": trace.stem if trace else "router",
            "delivery": delivery, "gpu_waits": gpu_waits}


def _experts(model: Any) -> int:
    return int(getattr(model.config, "num_experts", None)
               or getattr(model.config, "num_local_experts", 0))


def _count(arch: str) -> int:
    kw = ARCHS[arch][1]
    return int(kw.get("num_experts") or kw.get("num_local_experts") or 0)


def _cuda() -> Any:
    from host_client.cuda_device import CudaDevice

    return CudaDevice(0, mechanism="copy_engine")


def _accelerate(path: Path, device: str, batches: list[int], prompt: int, new: int,
                implementation: str, outputs: dict[int, Any], trace: Path | None,
                pinned: bool) -> dict[str, Any]:
    """accelerate's offload of the expert modules (left on the CPU, every other module on GPU
    0), with the resident run's experts ``implementation`` (and its ``outputs`` to compare
    with): from pageable memory as ``from_pretrained(device_map=...)`` leaves them, or with
    ``pinned`` from page-locked copies (the model loaded on the CPU, its expert parameters
    pinned, then ``accelerate.dispatch_model``: the offloaded weights it copies for each
    forward are the pinned ones)."""
    try:
        import accelerate
        import torch
        import transformers
    except ImportError as exc:
        return {"unavailable": f"accelerate is not installed ({exc})"}
    if device != "cuda":
        return {"unavailable": "needs a GPU (the modules are offloaded to the CPU)"}
    auto = transformers.AutoModelForCausalLM
    probe = auto.from_pretrained(path, dtype=torch.bfloat16, device_map="meta")
    offloaded = {n: "cpu" for n, _ in probe.named_modules() if n.endswith(".experts")}
    del probe
    if pinned:
        model = auto.from_pretrained(path, dtype=torch.bfloat16)
        for name in offloaded:
            for param in model.get_submodule(name).parameters():
                param.data = param.data.pin_memory()
        model = accelerate.dispatch_model(model, device_map={"": 0, **offloaded})
    else:
        model = auto.from_pretrained(path, dtype=torch.bfloat16,
                                     device_map={"": 0, **offloaded})
    model.set_experts_implementation(implementation)
    replay = TraceReplay(model, trace) if trace else None
    out, equal = {}, {}
    for b in batches:
        tps, ids = timed_generate(model, b, prompt, new, replay)
        out[b] = tps
        equal[b] = torch.equal(ids, outputs[b])
    return {"tokens_per_s": out, "outputs_equal": equal}


def plot(r: dict[str, Any], path: Path) -> None:
    fig, axes = figure(ncols=len(r["offload"][0]["tokens_per_s"]), size=(11, 4))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, b in zip(axes, r["offload"][0]["tokens_per_s"], strict=True):
        x = [100 * row["fraction"] for row in r["offload"]]
        ax.plot(x, [row["tokens_per_s"][b] for row in r["offload"]], "o-", label="offload_experts")
        ax.plot(x, [row["bound_tokens_per_s"][b] for row in r["offload"]], "k:", label="bound")
        ax.axhline(r["resident"][r["resident_implementation"]][b], color="g", ls="-.",
                   label=f"resident ({r['resident_implementation']})")
        for key, style, label in (("accelerate", "--", "accelerate offload"),
                                  ("accelerate_pinned", "-.", "accelerate offload, pinned")):
            acc = r.get(key, {}).get("tokens_per_s", {}).get(b)
            if acc:
                ax.axhline(acc, color="r", ls=style, label=label)
        ax.set(yscale="log", xlabel="GPU expert cache (%)", ylabel="tokens/s",
               title=f"{r['arch']}, {r['layers']} layers, batch {b}, routing "
                     f"{r.get('routing', 'router')}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--arch", choices=list(ARCHS), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=positive, default=4)
    ap.add_argument("--gpu-cache-fraction", type=fraction, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--batch", type=positive, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=positive, default=16)
    ap.add_argument("--shrink", type=positive, default=1, help="divide the sizes (smoke tests)")
    ap.add_argument("--trace", type=trace_path,
                    help="replay this routing trace instead of the router's choices")
    ap.add_argument("--delivery", choices=["engine", "pull"], default="engine",
                    help="engine: the agent's DMA-engine process fills the slots (no thread of "
                         "this process moves bytes); pull: the device's own consumer")
    ap.add_argument("--prefetch", action="store_true",
                    help="pre-gated prefetch: each layer prefetches what the next layer's "
                         "router would choose for its input (offload_experts(prefetch=True))")
    ap.add_argument("--host-waits", action="store_true",
                    help="offload_experts(gpu_waits=False): the host waits for each layer's "
                         "experts before launching its kernels (default: they are awaited on "
                         "the GPU, the kernels launched while the experts land)")
    ap.add_argument("--no-accelerate", action="store_true",
                    help="skip accelerate's baselines (an A/B of the offload path alone)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    keep_off_agent_cpus()
    r = run(args.arch, args.layers, args.device, args.gpu_cache_fraction, args.batch,
            new=args.new_tokens, shrink=args.shrink, trace=args.trace, delivery=args.delivery,
            prefetch=args.prefetch, accelerate=not args.no_accelerate,
            gpu_waits=not args.host_waits)
    print(json.dumps({k: r[k] for k in ("resident", "offload", "accelerate",
                                        "accelerate_pinned")}, indent=1,
                     default=str), file=sys.stderr)
    if not args.no_save:
        path = write("transformers-decode", envelope(
            "transformers-decode", r, device=args.device,
            command="python bench/transformers_decode.py " + " ".join(sys.argv[1:])),
            f"-{args.arch}-{args.device}" + (f"-{args.trace.stem}" if args.trace else "")
            + ("-prefetch" if args.prefetch else "") + ("-host-waits" if args.host_waits else ""))
        plot(r, path.with_suffix(".png"))
        print(f"wrote {path}")
    if r["outputs_differ"]:
        print(f"offloaded outputs differ from the resident run's at (cache, batch) "
              f"{r['outputs_differ']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
