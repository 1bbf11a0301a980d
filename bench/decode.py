"""Decode with offloaded experts: tokens per second as users measure it.

A decode loop over a checkpoint with the expert shapes of a real architecture (written by
make-checkpoint; layers and experts scaled down to fit the machine), routing replayed from a
trace (a real one from shared/traces, mapped layer -> layer mod L and expert -> expert mod E,
or the generator), the device's expert slots holding a fraction of all experts, misses served
through the agent, and each expert's SwiGLU FFN computed for real (CuPy on the GPU with
``--device cuda``, NumPy on the CPU reference device). Attention is a fixed stand-in,
``h <- h + 0.5 * tanh(h)``, so the figure isolates the MoE path; the gate weights are 1/k.
Every path launches a layer's expert FFNs one after another and waits for the GPU once per
layer, then releases the layer's experts with one post, as an inference engine's MoE layer
does (the next layer's routing needs this one's output). Until the thirty-fourth session the
loop waited for the GPU and released after every expert: each woken host thread launched the
next expert slowly, and each release rang the sleeping agent awake.

Paths in the same run and routing: ``offload`` (this project: each layer's experts asked for
in one batch posted without waiting for its grants, so the misses' transfers overlap and the
first FFNs are launched while the agent grants the rest; on the GPU each wait (its own grant,
then its bytes) is enqueued on the compute stream ahead of the expert's FFN, ``--wait host``
blocks the calling thread instead; a wait on the stream counts as waiting, from CUDA events),
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
                              [--timeline]
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
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    PARKED,
    agent_total,
    chunk_server,
    envelope,
    host_to_device_rate,
    http_fetch,
    keep_off_agent_cpus,
    trace_path,
    write,
)
from bench.decode_loop import Decoder, LruHost, routing
from bench.decode_table import plot, print_table, print_timeline
from dpu_offload.blob import SWIGLU_ROLES
from dpu_offload.cli_args import fraction, non_negative, positive
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import (
    CheckpointSpec,
    expert_tensor_names,
    make_checkpoint,
    read_tensor_bytes,
)
from host_client.launcher import AgentProcess

ARCHS = {  # arch: (checkpoint layout, hidden, moe intermediate, top-k)
    "qwen3-30b-a3b": ("qwen3-moe", 2048, 768, 8),
    "deepseek-v3-lite": ("qwen3-moe", 7168, 2048, 8),  # DeepSeek-V3 expert shapes, BF16
    "mixtral-8x7b": ("mixtral", 4096, 14336, 2),
}


DELIVERED = "dpu_agent_delivered_bytes_total"
"""Bytes the agent delivered to devices, by source."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--arch", choices=list(ARCHS), default="qwen3-30b-a3b")
    ap.add_argument("--gpu-cache-fraction", type=fraction, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--trace", type=trace_path)
    ap.add_argument("--tokens", type=positive, default=16)
    ap.add_argument("--layers", type=positive, default=2)
    ap.add_argument("--experts", type=positive, default=16)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-save", action="store_true", help="print only (make demo)")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of a results JSON")
    ap.add_argument("--delivery", choices=["pull", "engine"], default="pull",
                    help="engine: the agent's DMA-engine process writes the slots")
    ap.add_argument("--repeats", type=positive, default=1,
                    help="offload runs per cache fraction (the median is reported)")
    ap.add_argument("--wait", choices=["stream", "host"], default="stream",
                    help="on the GPU: wait for each expert on the compute stream (stream) or "
                         "in the calling thread (host)")
    ap.add_argument("--prefetch", type=non_negative, default=0, metavar="K",
                    help="after each layer, have the agent prefetch K predicted experts of the "
                         "next one (ReportRouting)")
    ap.add_argument("--profile", type=Path,
                    help="append a cProfile of each offload decode loop (main thread) here")
    ap.add_argument("--timeline", action="store_true",
                    help="record where each offload layer's time goes (host and CUDA events; "
                         "the first run of each fraction) and print it")
    args = ap.parse_args()
    keep_off_agent_cpus()
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
                 repeats=args.repeats, timeline=args.timeline)
    print_table(result)
    print_timeline(result)
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
        delivery: str = "pull", prefetch: int = 0, wait: str = "stream", repeats: int = 1,
        timeline: bool = False) -> dict[str, Any]:
    """``shrink`` divides hidden and intermediate sizes (tests only; 1 keeps the real ones).
    ``profile``: a text file that each fraction's offload loop appends its cProfile to.
    ``delivery``: "pull" (the device's consumer copies) or "engine" (the DMA engine does).
    ``prefetch``: experts of the next layer the agent prefetches after each layer (0: none).
    ``repeats``: offload runs per cache fraction, each from cold slots in a session of its own;
    the median (by tokens/s) is reported, every run's tokens/s in ``tokens_per_s_all``.
    ``wait``: on the GPU, "stream" enqueues each expert's wait for READY on the compute stream
    ahead of its FFN (``AcquireHandle.enqueue_wait``: the host never blocks on a slot), "host"
    blocks in ``AcquireHandle.wait`` first; the CPU device always waits on the host.
    ``timeline``: the first offload run of each fraction records where each layer's time went
    (``Decoder.run``'s records, in the run's ``timeline``)."""
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
            def offload_once(fraction: float, slots: int,
                             layer_times: list[dict[str, Any]] | None = None
                             ) -> tuple[dict[str, Any], dict[str, int], float]:
                """One offload decode from cold slots in a session of its own: (the run,
                hits and misses, bytes the agent moved); ``layer_times`` gets its timeline."""
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
                    # Not waiting for the grants: the first FFNs are launched meanwhile.
                    got = session.acquire_batch(dev, [ExpertKey("m", layer, e) for e in experts],
                                                wait=False)
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

                def release(layer: int, experts: list[int]) -> None:
                    if stream_wait:
                        for e in experts:
                            waits.pop(e).check()  # the FFN read verified bytes
                    session.release_batch(dev, [ExpertKey("m", layer, e) for e in experts])

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
                    off = decoder.run(fetch, release, tokens, begin, layer_times)
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
                layer_times: list[dict[str, Any]] | None = [] if timeline else None
                tries = sorted((offload_once(fraction, slots, layer_times if i == 0 else None)
                                for i in range(repeats)), key=lambda t: t[0]["tokens_per_s"])
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
                per_token = moved_bytes / tokens
                bound = serial_bound(reference_out["compute_s_per_token"], per_token, bandwidth)
                # The same bound from the resident kernels run just before this offload run,
                # beside its agent: on a machine whose pace drifts within the benchmark, the
                # baseline nearest in time.
                bound_beside = serial_bound(
                    off["resident_beside_agent"]["compute_s_per_token"], per_token, bandwidth)
                results["runs"].append({
                    "fraction": fraction, "slots": slots, "hit_rate": stats["hits"] / acc,
                    "bytes_fetched_per_token": missed_bytes / tokens,
                    "bytes_moved_per_token": moved_bytes / tokens,
                    "offload": off, "pageable": pg, "http": ht,
                    "resident_tokens_per_s": reference_out["tokens_per_s"],
                    "bound_tokens_per_s": bound,
                    "offload_vs_bound": off["tokens_per_s"] / bound,
                    "bound_beside_agent_tokens_per_s": bound_beside,
                    "offload_vs_bound_beside_agent": off["tokens_per_s"] / bound_beside,
                    "offload_vs_http": off["tokens_per_s"] / ht["tokens_per_s"]})
                if layer_times is not None:
                    results["runs"][-1]["timeline"] = layer_times
            server.shutdown()
        reference_out.pop("outputs")
        results["resident"] = reference_out
    return results


def serial_bound(compute_s_per_token: float, bytes_per_token: float, bandwidth: float
                 ) -> float:
    """Tokens/s with each token's expert compute and its moved bytes (at ``bandwidth`` bytes/s)
    in series: 1 / (compute + bytes / bandwidth)."""
    return 1 / (compute_s_per_token + bytes_per_token / bandwidth)


def fetch_http(server: Any, layer: int, e: int, inter: int, hidden: int
               ) -> tuple[np.ndarray, ...]:
    """The Expert Kit-style miss path: 1 MiB HTTP chunks into a host buffer."""
    flat = np.frombuffer(http_fetch(server, f"{layer}-{e}", 3 * inter * hidden * 2), np.uint16)
    n = inter * hidden
    return (flat[:n].reshape(inter, hidden), flat[n:2 * n].reshape(inter, hidden),
            flat[2 * n:].reshape(hidden, inter))


if __name__ == "__main__":
    sys.exit(main())
