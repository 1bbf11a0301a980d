"""Decode with offloaded experts: tokens per second as users measure it.

A decode loop over a checkpoint with the expert shapes of a real architecture (written by
make-checkpoint; layers and experts scaled down to fit the machine), routing replayed from a
trace (a real one from shared/traces, mapped layer -> layer mod L and expert -> expert mod E,
or the generator), the device's expert slots holding a fraction of all experts, misses served
through the agent, and each expert's SwiGLU FFN computed for real (CuPy on the GPU with
``--device cuda``, NumPy on the CPU reference device). Attention is a fixed stand-in,
``h <- h + 0.5 * tanh(h)``, so the figure isolates the MoE path; the gate weights are 1/k.

Paths in the same run and routing: ``offload`` (this project: each layer's experts asked for
in one AcquireBatch, so the misses' transfers overlap and are waited for in order; on the GPU
each wait is enqueued on the compute stream ahead of the expert's FFN, ``--wait host`` blocks
the calling thread instead; a wait on the stream counts as waiting, from CUDA events),
``resident`` (every expert in a slot: the upper bound; measured again in each offload run
with that run's agent and DMA engine up, as ``resident_beside_agent``, since here they share
the host's cores with the inference process), ``pageable`` (a synchronous copy from
host memory on each miss) and ``http`` (Expert Kit style: 1 MiB HTTP chunks into a host
buffer, then a copy). Reported per
path and cache fraction: tokens/s, time per token split into expert compute, waiting for
experts and the rest, hit rate, bytes fetched per token, and the bound set by the bytes the
agent moved (the misses'; with ``--prefetch`` every prefetch's too, read from its
``dpu_agent_delivered_bytes``) over the copy bandwidth measured in the same run (pinned
host-to-device on the GPU, a host memcpy on the CPU device). On the GPU the offload device uses
the copy-engine mechanism (one GPU serves several registered devices here, and persistent
kernels would compete for SMs).

With ``--prefetch K`` the offload path also reports each layer's routing to the agent
(``report_visit``: ROUTE entries on the device's request ring, no gRPC call; before the
twenty-second session a ReportRouting call per layer) and has it prefetch the K experts its
next-layer predictor expects the following layer to select into the same device's slots: a
prefetched expert its layer then asks for counts as a hit (ready or on its way when needed),
and the tokens per second show what prediction is worth against the bandwidth its misses
waste.

Usage: python bench/decode.py [--device cpu|cuda] [--arch qwen3-30b-a3b]
                              [--gpu-cache-fraction 0.1 0.25 0.5] [--trace FILE] [--tokens N]
                              [--layers L] [--experts E] [--prefetch K] [--json]
                              [--wait stream|host] [--repeats N] [--profile FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    PARKED,
    agent_total,
    chunk_server,
    envelope,
    figure,
    host_to_device_rate,
    http_fetch,
    save_figure,
    write,
)
from dpu_agent.routing.traces import generate_trace, read_trace
from dpu_offload.blob import SWIGLU_ROLES
from dpu_offload.keys import ExpertKey
from gpu_kernels import reference
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import (
    CheckpointSpec,
    expert_tensor_names,
    make_checkpoint,
    read_tensor_bytes,
)
from host_client.launcher import AgentProcess
from host_client.worker import expert_ffn

ARCHS = {  # arch: (checkpoint layout, hidden, moe intermediate, top-k)
    "qwen3-30b-a3b": ("qwen3-moe", 2048, 768, 8),
    "deepseek-v3-lite": ("qwen3-moe", 7168, 2048, 8),  # DeepSeek-V3 expert shapes, BF16
    "mixtral-8x7b": ("mixtral", 4096, 14336, 2),
}


def routing(trace: Path | None, layers: int, experts: int, top_k: int, tokens: int
            ) -> list[list[list[int]]]:
    """[token][layer] -> distinct experts."""
    if trace is None:
        steps = list(generate_trace(layers, experts, top_k, tokens, seed=7))
        return [[sorted(set(steps[t * layers + la].experts)) for la in range(layers)]
                for t in range(tokens)]
    raw = read_trace(trace)
    n_layers = max(s.layer for s in raw) + 1
    out = []
    for t in range(tokens):
        row = []
        for la in range(layers):
            step = raw[(t * n_layers + la % n_layers) % len(raw)]
            row.append(sorted({e % experts for e in step.experts}))
        out.append(row)
    return out


DELIVERED = "dpu_agent_delivered_bytes_total"
"""Bytes the agent delivered to devices, by source."""


class Decoder:
    """The decode loop; ``fetch(layer, expert)`` returns the expert's (gate, up, down) bf16
    arrays, counting the time it waits."""

    def __init__(self, hidden: int, layer_ids: list[int], route: list[list[list[int]]],
                 xp: Any = np):
        self.hidden, self.layer_ids, self.route, self.xp = hidden, layer_ids, route, xp

    def sync(self) -> None:
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def _event(self) -> Any:
        """On the GPU, a CUDA event recorded now on the current stream (None on the CPU)."""
        if self.xp is np:
            return None
        event = self.xp.cuda.Event()
        event.record()
        return event

    def run(self, fetch: Any, release: Any, tokens: int, begin: Any = None
            ) -> dict[str, Any]:
        """Decode ``tokens`` tokens. ``begin(layer, experts)``, when given, is told each
        layer's experts before the first ``fetch`` (the offload path asks for them all in
        one AcquireBatch so their transfers overlap); its time counts as waiting. Besides the
        whole run's tokens/s: the first token's seconds (``first_token_s``: cold slots, and the
        first request each process serves) and the tokens/s of the rest
        (``steady_tokens_per_s``, None for one token)."""
        xp = self.xp
        x = reference.f32_to_bf16(xp.linspace(-1, 1, self.hidden, dtype=np.float32)[None])
        compute = wait = 0.0
        # Per expert, CUDA events: before fetch, after it, after the FFN's own launches, after
        # the accumulation.
        marks: list[tuple[Any, Any, Any, Any]] = []
        outputs = []
        t_start = time.perf_counter()
        first_token = 0.0
        for t in range(tokens):
            h = reference.bf16_to_f32(x).copy()
            for la, layer in enumerate(self.layer_ids):
                h = h + 0.5 * xp.tanh(h)  # the attention stand-in
                experts = self.route[t][la]
                acc = xp.zeros_like(h)
                hb = reference.f32_to_bf16(h)
                if begin is not None:
                    t0 = time.perf_counter()
                    begin(layer, experts)
                    wait += time.perf_counter() - t0
                for e in experts:
                    t0 = time.perf_counter()
                    before = self._event()
                    w = fetch(layer, e)
                    t1 = time.perf_counter()
                    fetched = self._event()
                    y = expert_ffn(hb, *w)
                    ffn_done = self._event()
                    acc += reference.bf16_to_f32(y) / len(experts)
                    if fetched is not None:
                        marks.append((before, fetched, ffn_done, self._event()))
                    self.sync()
                    t2 = time.perf_counter()
                    # The stream is idle at ``before`` (synced after each expert), so on the GPU
                    # the wait is ``before`` -> ``fetched``: the host's wait in ``fetch`` or a
                    # wait it enqueued on the stream, which ends inside the sync above.
                    waited = (t1 - t0 if fetched is None
                              else xp.cuda.get_elapsed_time(before, fetched) / 1e3)
                    wait += waited
                    compute += t2 - t0 - waited
                    release(layer, e)
                h = h + acc
            outputs.append(reference.f32_to_bf16(h))
            x = reference.f32_to_bf16(xp.tanh(h))  # next token's input
            if t == 0:
                self.sync()
                first_token = time.perf_counter() - t_start
        self.sync()
        total = time.perf_counter() - t_start
        gpu = (sum(xp.cuda.get_elapsed_time(b, d) for _, b, _, d in marks) / 1e3 / tokens
               if marks else None)
        ffn = (sum(xp.cuda.get_elapsed_time(b, c) for _, b, c, _ in marks) / 1e3 / tokens
               if marks else None)
        return {"tokens_per_s": tokens / total, "first_token_s": first_token,
                "steady_tokens_per_s": ((tokens - 1) / (total - first_token)
                                        if tokens > 1 else None),
                "compute_s_per_token": compute / tokens,
                "gpu_compute_s_per_token": gpu,
                "gpu_ffn_s_per_token": ffn,
                "wait_s_per_token": wait / tokens,
                "other_s_per_token": (total - compute - wait) / tokens,
                "outputs": xp.concatenate(outputs)}


class LruHost:
    """A host-memory expert cache of ``capacity`` experts filled by ``load(layer, e)``."""

    def __init__(self, capacity: int, load: Any) -> None:
        self.capacity, self.load = capacity, load
        self.slots: OrderedDict[tuple[int, int], tuple[np.ndarray, ...]] = OrderedDict()
        self.hits = self.misses = 0

    def fetch(self, layer: int, e: int) -> tuple[np.ndarray, ...]:
        key = (layer, e)
        if key in self.slots:
            self.hits += 1
            self.slots.move_to_end(key)
            return self.slots[key]
        self.misses += 1
        if len(self.slots) >= self.capacity:
            self.slots.popitem(last=False)
        w = self.slots[key] = self.load(layer, e)
        return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--arch", choices=list(ARCHS), default="qwen3-30b-a3b")
    ap.add_argument("--gpu-cache-fraction", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-save", action="store_true", help="print only (make demo)")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of a results JSON")
    ap.add_argument("--delivery", choices=["pull", "engine"], default="pull",
                    help="engine: the agent's DMA-engine process writes the slots")
    ap.add_argument("--repeats", type=int, default=1,
                    help="offload runs per cache fraction (the median is reported)")
    ap.add_argument("--wait", choices=["stream", "host"], default="stream",
                    help="on the GPU: wait for each expert on the compute stream (stream) or "
                         "in the calling thread (host)")
    ap.add_argument("--prefetch", type=int, default=0, metavar="K",
                    help="after each layer, have the agent prefetch K predicted experts of the "
                         "next one (ReportRouting)")
    ap.add_argument("--profile", type=Path,
                    help="append a cProfile of each offload decode loop (main thread) here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if not 0 <= args.prefetch <= args.experts:
        ap.error(f"--prefetch must be between 0 and --experts ({args.experts})")
    if args.replot:
        plot(json.loads(args.replot.read_text())["results"], args.replot.with_suffix(".png"))
        return 0
    result = run(args.arch, args.gpu_cache_fraction, args.trace, args.tokens, args.layers,
                 args.experts, device=args.device, profile=args.profile,
                 delivery=args.delivery, prefetch=args.prefetch, wait=args.wait,
                 repeats=args.repeats)
    print_table(result)
    if args.no_save:
        return 0
    path = write("decode", envelope("decode", result, device=args.device,
                                    command="python bench/decode.py " + " ".join(sys.argv[1:])),
                 f"-{args.arch}-{args.device}"
                 + ("-engine" if args.delivery == "engine" else "")
                 + (f"-{args.experts}experts" if args.experts != 16 else "")
                 + (f"-{args.trace.stem}" if args.trace else "")
                 + (f"-prefetch{args.prefetch}" if args.prefetch else "")
                 + ("-hostwait" if args.device == "cuda" and args.wait == "host" else ""))
    plot(result, path.with_suffix(".png"))
    print(json.dumps(result) if args.json else f"wrote {path}")
    return 0


def run(arch: str, fractions: list[float], trace: Path | None, tokens: int, layers: int,
        experts: int, shrink: int = 1, device: str = "cpu", profile: Path | None = None,
        delivery: str = "pull", prefetch: int = 0, wait: str = "stream", repeats: int = 1
        ) -> dict[str, Any]:
    """``shrink`` divides hidden and intermediate sizes (tests only; 1 keeps the real ones).
    ``profile``: a text file that each fraction's offload loop appends its cProfile to.
    ``delivery``: "pull" (the device's consumer copies) or "engine" (the DMA engine does).
    ``prefetch``: experts of the next layer the agent prefetches after each layer (0: none).
    ``repeats``: offload runs per cache fraction, each from cold slots in a session of its own;
    the median (by tokens/s) is reported, every run's tokens/s in ``tokens_per_s_all``.
    ``wait``: on the GPU, "stream" enqueues each expert's wait for READY on the compute stream
    ahead of its FFN (``AcquireHandle.enqueue_wait``: the host never blocks on a slot), "host"
    blocks in ``AcquireHandle.wait`` first; the CPU device always waits on the host."""
    xp: Any = np
    if device == "cuda":
        import cupy as xp

        from host_client.cuda_device import CudaDevice
    stream_wait = device == "cuda" and wait == "stream"
    layout, hidden, inter, top_k = ARCHS[arch]
    hidden, inter = hidden // shrink, inter // shrink
    top_k = min(top_k, experts)
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        root = make_checkpoint(Path(tmp) / "m", CheckpointSpec(
            layout, layers=layers, experts=experts, hidden=hidden, intermediate=inter,
            top_k=top_k), layers_per_shard=1)
        truth = read_tensor_bytes(root)

        def host_weights(layer: int, e: int) -> tuple[np.ndarray, ...]:
            names = expert_tensor_names(layout, layer, e)
            shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
            return tuple(np.frombuffer(truth[names[r]], np.uint16).reshape(s)
                         for r, s in zip(SWIGLU_ROLES, shapes, strict=True))

        def to_device(w: tuple[np.ndarray, ...]) -> tuple[Any, ...]:
            return w if xp is np else tuple(xp.asarray(a) for a in w)

        route = routing(trace, layers, experts, top_k, tokens)
        decoder = Decoder(hidden, list(range(layers)), route, xp)
        expert_bytes = 3 * hidden * inter * 2
        bandwidth = host_to_device_rate(device, 0, expert_bytes * 4)
        resident = {(la, e): to_device(host_weights(la, e)) for la in range(layers)
                    for e in range(experts)}
        decoder.run(lambda la, e: resident[la, e], lambda *_: None, min(tokens, 2))  # warm-up
        reference_out = decoder.run(lambda la, e: resident[la, e], lambda *_: None, tokens)
        results: dict[str, Any] = {"arch": arch, "delivery": delivery, "prefetch": prefetch,
                                   "wait": "stream" if stream_wait else "host",
                                   "repeats": repeats,
                                   "hidden": hidden,
                                   "intermediate": inter,
                                   "top_k": top_k, "layers": layers, "experts": experts,
                                   "tokens": tokens, "device": device,
                                   "copy_bandwidth_gbps": bandwidth / 1e9,
                                   "runs": []}
        arena_mib = max(4096, layers * experts * expert_bytes * 5 // 4 >> 20)
        with AgentProcess(f'[arena]\nbytes = "{arena_mib}MiB"\n'
                          '[metrics]\nlisten_address = "127.0.0.1:0"\n') as agent, \
                AgentClient(agent.address, rpc_timeout=120) as client:
            model = client.load_model(str(root), "m")
            server = chunk_server({f"{la}-{e}": b"".join(w.tobytes() for w in
                                                         host_weights(la, e))
                                   for la in range(layers) for e in range(experts)})
            # Warm the arena (the DPU cache) once; every timed run starts with cold slots.
            warm = client.register_device(CpuReferenceDevice(99), [SlotPoolSpec(
                model.expert_bytes, layers * experts)])
            keys = [ExpertKey("m", la, e) for la in range(layers) for e in range(experts)]
            for h in client.acquire_batch(warm, keys):
                h.wait(300)
            for k in keys:
                client.release(warm, k)
            def offload_once(fraction: float, slots: int
                             ) -> tuple[dict[str, Any], dict[str, int], float]:
                """One offload decode from cold slots in a session of its own: (the run,
                hits and misses, bytes the agent moved)."""
                # A session per run: a session registers each GPU ordinal once.
                session = AgentClient(agent.address, rpc_timeout=120)
                session.load_model(str(root), "m")  # as an inference process does
                made = (CudaDevice(0, mechanism="copy_engine") if device == "cuda" else
                        CpuReferenceDevice(len(results["runs"])))
                dev = session.register_device(made, [SlotPoolSpec(model.expert_bytes, slots)],
                                              delivery=delivery)
                stats = {"hits": 0, "misses": 0}
                handles: dict[int, Any] = {}

                def begin(layer: int, experts: list[int]) -> None:
                    # Releases posted before are served first: the slots they free are free.
                    got = session.acquire_batch(dev, [ExpertKey("m", layer, e) for e in experts])
                    handles.clear()
                    handles.update(zip(experts, got, strict=True))
                    if prefetch:
                        session.report_visit(dev, "m", layer, dict.fromkeys(experts, 1),
                                             prefetch=prefetch)

                waits: dict[int, Any] = {}

                def fetch(layer: int, e: int) -> tuple[np.ndarray, ...]:
                    if stream_wait:
                        waits[e] = handles[e].enqueue_wait(xp.cuda.get_current_stream(), 120)
                        slot = waits[e].slot
                    else:
                        slot = handles[e].wait(120)
                    stats["hits" if handles[e].resident else "misses"] += 1
                    return tuple(slot.tensor(r) for r in SWIGLU_ROLES)

                def release(layer: int, e: int) -> None:
                    if stream_wait:
                        waits.pop(e).check()  # the FFN read verified bytes
                    session.release(dev, ExpertKey("m", layer, e), wait=False)

                # The same resident kernels with this run's agent and DMA engine up and its
                # device attached: what sharing the host's cores with them costs the compute
                # (on a BlueField they run on the DPU's own cores).
                beside = decoder.run(lambda la, e: resident[la, e], lambda *_: None, tokens)
                beside.pop("outputs")
                prof = cProfile.Profile() if profile else None
                calls = sum(session.rpc_calls.values()) - session.rpc_calls["KeepAlive"]
                delivered = agent_total(agent, DELIVERED)
                parked = agent_total(agent, PARKED)
                with prof or contextlib.nullcontext():
                    off = decoder.run(fetch, release, tokens, begin)
                off["parked_acquires_per_token"] = (agent_total(agent, PARKED) - parked) / tokens
                time.sleep(0.05)  # prefetches still landing count as moved bytes too
                # The bytes the agent moved: the misses' and, with prefetch, every prefetch's
                # (used or wasted); the bound charges them all.
                moved = agent_total(agent, DELIVERED) - delivered
                off["resident_beside_agent"] = beside
                off["grpc_calls_per_token"] = (sum(session.rpc_calls.values()) - calls
                                               - session.rpc_calls["KeepAlive"]) / tokens
                if prof is not None and profile is not None:
                    with profile.open("a") as f:
                        f.write(f"== offload decode loop, {arch}, cache {fraction:.0%}\n")
                        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
                session.close()
                assert bool((off.pop("outputs") == reference_out["outputs"]).all()), \
                    "offloaded decode differs from the dense reference"
                return off, stats, moved

            for fraction in fractions:
                slots = max(top_k, round(fraction * layers * experts))
                tries = sorted((offload_once(fraction, slots) for _ in range(repeats)),
                               key=lambda t: t[0]["tokens_per_s"])
                off, stats, moved_bytes = tries[len(tries) // 2]  # the median run
                off["tokens_per_s_all"] = [t[0]["tokens_per_s"] for t in tries]
                acc = stats["hits"] + stats["misses"]
                misses = stats["misses"]
                pageable = LruHost(slots, lambda la, e: to_device(tuple(
                    w.copy() for w in host_weights(la, e))))
                pg = decoder.run(pageable.fetch, lambda *_: None, tokens)
                pg.pop("outputs")
                staged = LruHost(slots, lambda la, e: to_device(fetch_http(server, la, e, inter,
                                                                           hidden)))
                ht = decoder.run(staged.fetch, lambda *_: None, tokens)
                ht.pop("outputs")
                missed_bytes = misses * expert_bytes
                compute = reference_out["compute_s_per_token"]
                bound = tokens / (tokens * compute + moved_bytes / bandwidth)
                results["runs"].append({
                    "fraction": fraction, "slots": slots, "hit_rate": stats["hits"] / acc,
                    "bytes_fetched_per_token": missed_bytes / tokens,
                    "bytes_moved_per_token": moved_bytes / tokens,
                    "offload": off, "pageable": pg, "http": ht,
                    "resident_tokens_per_s": reference_out["tokens_per_s"],
                    "bound_tokens_per_s": bound,
                    "offload_vs_bound": off["tokens_per_s"] / bound,
                    "offload_vs_http": off["tokens_per_s"] / ht["tokens_per_s"]})
            server.shutdown()
        reference_out.pop("outputs")
        results["resident"] = reference_out
    return results


def fetch_http(server: Any, layer: int, e: int, inter: int, hidden: int
               ) -> tuple[np.ndarray, ...]:
    """The Expert Kit-style miss path: 1 MiB HTTP chunks into a host buffer."""
    flat = np.frombuffer(http_fetch(server, f"{layer}-{e}", 3 * inter * hidden * 2), np.uint16)
    n = inter * hidden
    return (flat[:n].reshape(inter, hidden), flat[n:2 * n].reshape(inter, hidden),
            flat[2 * n:].reshape(hidden, inter))


def plot(r: dict[str, Any], path: Path) -> None:
    """Tokens per second against the cache fraction, one line per path."""
    runs = sorted(r["runs"], key=lambda run: run["fraction"])
    x = [100 * run["fraction"] for run in runs]
    fig, ax = figure(size=(6.5, 4))
    for label, get, style in (
            ("offload (agent)", lambda run: run["offload"]["tokens_per_s"], "o-"),
            ("bound: missed bytes / pinned H2D", lambda run: run["bound_tokens_per_s"], "k:"),
            ("pageable copy on miss", lambda run: run["pageable"]["tokens_per_s"], "x--"),
            ("host-staged HTTP", lambda run: run["http"]["tokens_per_s"], "x--"),
            ("all resident", lambda run: run["resident_tokens_per_s"], "g-.")):
        ax.plot(x, [get(run) for run in runs], style, label=label)
    ax.set(yscale="log", xlabel="GPU expert cache (% of all experts)", ylabel="tokens/s",
           title=f"decode, {r['arch']} ({r['layers']} layers x {r['experts']} experts), "
                 f"{r['device']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def gpu_ratio(run: dict[str, Any], resident_gpu: float | None) -> str:
    """The run's expert-kernel GPU time over the resident run's ("-" without a GPU)."""
    gpu = run.get("gpu_compute_s_per_token")
    return f"{gpu / resident_gpu:.2f}" if gpu and resident_gpu else "-"


def beside_ratio(run: dict[str, Any], resident: float, resident_gpu: float | None) -> str:
    """The resident kernels' compute (GPU) time with the run's agent and engine up, over the
    resident run's before the agent started ("-" for results without it)."""
    beside = run.get("resident_beside_agent")
    if beside is None:
        return "-"
    return (f"{beside['compute_s_per_token'] / resident:.2f} "
            f"({gpu_ratio(beside, resident_gpu)})")


def print_table(r: dict[str, Any]) -> None:
    print(f"{r['arch']}: {r['layers']} layers x {r['experts']} experts, top-{r['top_k']}, "
          f"{r['tokens']} tokens; resident {r['resident']['tokens_per_s']:.1f} tok/s"
          + (f"; next-layer prefetch of {r['prefetch']}" if r.get("prefetch") else ""),
          file=sys.stderr)
    print(" cache  hit rate  offload tok/s  (after the 1st)  (wait ms/tok)  compute x resident  "
          "(GPU x res.)  "
          "(resident beside agent)  gRPC/tok  MB/tok missed (moved)  bound  pageable  http  "
          "x bound  x http", file=sys.stderr)
    resident = r["resident"]["compute_s_per_token"]
    resident_gpu = r["resident"].get("gpu_compute_s_per_token")
    for run in r["runs"]:
        o = run["offload"]
        steady = o.get("steady_tokens_per_s")
        print(f" {run['fraction']:5.0%}  {run['hit_rate']:8.2f}  {o['tokens_per_s']:13.1f}  "
              f"({'-' if steady is None else f'{steady:.1f}':>13})  "
              f"({o['wait_s_per_token'] * 1e3:11.1f})  "
              f"{o['compute_s_per_token'] / resident:18.2f}  "
              f"({gpu_ratio(o, resident_gpu):>11})  "
              f"({beside_ratio(o, resident, resident_gpu):>21})  "
              f"{o.get('grpc_calls_per_token', float('nan')):8.2f}  "
              f"{run['bytes_fetched_per_token'] / 1e6:9.1f} "
              f"({run.get('bytes_moved_per_token', float('nan')) / 1e6:7.1f})  "
              f"{run['bound_tokens_per_s']:5.1f}  "
              f"{run['pageable']['tokens_per_s']:8.1f}  {run['http']['tokens_per_s']:4.1f}  "
              f"{run['offload_vs_bound']:7.2f}  {run['offload_vs_http']:6.2f}", file=sys.stderr)
    resident_ffn = r["resident"].get("gpu_ffn_s_per_token")
    if resident_ffn:
        cells = []
        for run in r["runs"]:
            off = run["offload"]
            cells.append(f"{run['fraction']:.0%} offload {off['gpu_ffn_s_per_token'] * 1e3:.2f} "
                         f"({off['gpu_ffn_s_per_token'] / resident_ffn:.2f}x), beside the agent "
                         f"{off['resident_beside_agent']['gpu_ffn_s_per_token'] * 1e3:.2f}")
        print(f" the FFN's own launches, GPU ms per token (resident {resident_ffn * 1e3:.2f}): "
              + "; ".join(cells), file=sys.stderr)
    if any(run["offload"].get("parked_acquires_per_token") for run in r["runs"]):
        print(" acquires parked for a landing slot per token: " + "; ".join(
            f"{run['fraction']:.0%} {run['offload'].get('parked_acquires_per_token', 0):.2f}"
            for run in r["runs"]), file=sys.stderr)
    if r.get("repeats", 1) > 1:
        print(" offload tok/s of each run (the median above): " + "; ".join(
            f"{run['fraction']:.0%} " + " / ".join(
                f"{v:.1f}" for v in run["offload"]["tokens_per_s_all"]) for run in r["runs"]),
            file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
