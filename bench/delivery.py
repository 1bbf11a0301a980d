"""Delivery benchmark: arena -> GPU slots through the whole system, against baselines measured
in the same run.

Per expert shape (Qwen3-30B-A3B BF16, 9.4 MB; DeepSeek-V3 FP8, 44 MB; and a small one):
- ``agent_delivery``: the agent posts chunk descriptors; the device's mechanism (the persistent
  receive kernel pulling from the registered arena, or the copy engine driven by a host thread;
  ``--mechanisms``) moves and verifies the chunks; the completion reaches the client. Experts
  are resident in the arena (second pass) and absent from the GPU (the pool holds half of them).
- ``copy_engine_arena``: cudaMemcpyAsync from the registered arena, same bytes (no rings).
- ``pinned_h2d``: cudaMemcpyAsync from pinned host memory (the reference rate).
- ``pageable_h2d``: ``cupy.asarray`` of a NumPy array (GPU only).
- ``http_staged``: Expert Kit style: 1 MiB HTTP chunks into a host buffer, then a copy.
Also: acquire-to-ready latency of one cold (GPU-absent, arena-resident) expert and the Acquire
RPC's share of it (likewise the AcquireBatch RPC's share of a batch), host-client CPU
seconds per GB delivered and agent CPU seconds per GB scheduled.

Usage: python bench/delivery.py [--device cuda|cpu] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    PARKED,
    CpuSnapshot,
    agent_total,
    child_pid,
    envelope,
    figure,
    keep_off_agent_cpus,
    median,
    pct,
    save_figure,
    scrape,
    write,
)
from bench.delivery_baselines import baselines, copy_engine_from_arena
from bench.delivery_stages import agent_request_times, batch_timeline, stage_breakdown
from dpu_offload.cli_args import positive
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess

SHAPES = {
    # name: (arch, hidden, intermediate, dtype)
    "small-4.7MB": ("qwen3-moe", 1024, 768, "bf16"),
    "qwen3-30b-a3b-9.4MB": ("qwen3-moe", 2048, 768, "bf16"),
    "deepseek-v3-44MB": ("deepseek-v3", 7168, 2048, "fp8"),
}


def log(msg: str) -> None:
    print(f"[delivery] {msg}", file=sys.stderr, flush=True)


def run_shape(name: str, device_kind: str, experts: int, repeats: int,
              workdir: Path, chunk_bytes: int, mechanism: str = "auto") -> dict[str, object]:
    arch, hidden, inter, dtype = SHAPES[name]
    root = make_checkpoint(workdir / name, CheckpointSpec(
        arch, layers=1, experts=experts, hidden=hidden, intermediate=inter, dtype=dtype,
        dense_layers=0), layers_per_shard=1)
    gpu = device_kind == "cuda"
    log(f"{name}: checkpoint written")
    settings = (f'[arena]\nbytes = "1GiB"\n[transfer]\nchunk_bytes = {chunk_bytes}\n'
                '[metrics]\nlisten_address = "127.0.0.1:0"\n')
    with AgentProcess(settings) as agent:
        client = AgentClient(agent.address, client_name="bench-delivery")
        try:
            model = client.load_model(str(root), "m")
            delivery = "engine" if mechanism == "engine" else "pull"
            if gpu:
                from host_client.cuda_device import CudaDevice

                device = CudaDevice(0, mechanism="kernel" if delivery == "engine" else mechanism)
            else:
                device = CpuReferenceDevice()
            half = experts // 2
            dev = client.register_device(device, [SlotPoolSpec(model.expert_bytes, half)],
                                         ring_capacity=4096, delivery=delivery)
            layer = model.moe_layers[0]
            keys = [ExpertKey("m", layer, e) for e in range(experts)]

            rpc: list[float] = []
            phases: Counter[str] = Counter()
            """The calling thread's CPU seconds in each step of the measured cycles."""

            def cycle(batch: list[ExpertKey]) -> float:
                """One AcquireBatch RPC for the batch (as a layer's experts are asked for), then
                wait for every slot; returns seconds (the RPC's share goes to ``rpc``, the
                calling thread's CPU per step to ``phases``)."""
                c0, t0 = time.thread_time(), time.perf_counter()
                handles = client.acquire_batch(dev, batch)
                c1 = time.thread_time()
                rpc.append(time.perf_counter() - t0)
                client.wait_all(handles, 120)
                c2, dt = time.thread_time(), time.perf_counter() - t0
                client.release_batch(dev, batch)
                phases["acquire_batch"] += c1 - c0
                phases["wait_all"] += c2 - c1
                phases["release_batch"] += time.thread_time() - c2
                return dt

            cycle(keys[:half])  # cold: checkpoint -> arena -> GPU
            cycle(keys[half:])  # evicts every GPU slot; arena now holds all experts
            log(f"{name}: arena warm")
            phases.clear()
            bw, cpu_client, cpu_engine, nbytes_total = [], 0.0, 0.0, 0
            by_thread: Counter[str] = Counter()
            agent_threads: Counter[str] = Counter()
            engine = child_pid(agent.proc.pid, "dma_engine")
            rpc.clear()
            parked = agent_total(agent, PARKED)
            for r in range(repeats):
                batch = keys[:half] if r % 2 == 0 else keys[half:]
                # Reading another process's /proc costs this one ~1 ms: outside the client's
                # interval (it once was inside, and made up half the client's CPU per GB).
                agent0 = CpuSnapshot.take(agent.proc.pid)
                engine0 = CpuSnapshot.take(engine) if engine else None
                threads0 = CpuSnapshot.take(os.getpid())
                c0 = time.process_time()
                dt = cycle(batch)
                cpu_client += time.process_time() - c0
                by_thread.update(CpuSnapshot.take(os.getpid()).since(threads0))
                agent_threads.update(CpuSnapshot.take(agent.proc.pid).since(agent0))
                if engine0 is not None:
                    cpu_engine += CpuSnapshot.take(engine).total_since(engine0)
                nbytes_total += half * model.expert_bytes
                bw.append(half * model.expert_bytes / dt / 1e9)
            parked = agent_total(agent, PARKED) - parked
            log(f"{name}: bandwidth {bw}")
            step_cpu = {step: s / (repeats * half) * 1e6 for step, s in phases.items()}
            batch_rpc = rpc[:]
            lat, single_rpc, grant = [], [], []
            resident, other = keys[half:], keys[:half]  # the last cycle loaded keys[half:]
            if repeats % 2:
                resident, other = other, resident
            for r in range(max(8, repeats * 2)):
                k = other[r % half]  # in the arena, not on the GPU
                t0 = time.perf_counter()
                handle = client.acquire(dev, k)
                single_rpc.append(time.perf_counter() - t0)
                while not handle.granted():  # the agent's reply: which slot
                    pass
                grant.append(time.perf_counter() - t0)
                handle.wait(60)
                lat.append(time.perf_counter() - t0)
                client.release(dev, k)
                cycle(resident)  # evicts k again
            before = scrape(agent)
            stages = stage_breakdown(client, dev, other, resident, max(8, repeats * 2), cycle)
            stages.update(agent_request_times(before, scrape(agent)))
            # An even count: the batch loaded last is ``resident`` again, as the hits need.
            timeline = batch_timeline(client, dev, (other, resident), 2 * max(4, repeats))
            hit, pinned = [], 0
            for r in range(max(20, repeats * 4)):  # an expert already READY in a slot
                k = resident[r % half]
                t0 = time.perf_counter()
                handle = client.acquire(dev, k)
                handle.wait(10)
                hit.append(time.perf_counter() - t0)
                pinned += handle.pinned_hit
                client.release(dev, k, wait=False)
            log(f"{name}: latency done")
            result: dict[str, object] = {
                "expert_bytes": model.expert_bytes,
                "chunk_bytes": chunk_bytes,
                "experts_per_batch": half,
                "agent_delivery_gbps": median(bw),
                "agent_delivery_gbps_all": bw,
                "parked_acquires_per_batch": parked / repeats,
                "acquire_batch_rpc_p50_ms": median(batch_rpc) * 1e3,
                "acquire_to_ready_p50_ms": median(lat) * 1e3,
                "acquire_to_ready_p99_ms": pct(lat, 99) * 1e3,
                "acquire_rpc_p50_ms": median(single_rpc) * 1e3,
                "acquire_to_grant_p50_ms": median(grant) * 1e3,
                "ready_hit_p50_us": median(hit) * 1e6,
                "ready_hit_pinned_fraction": pinned / len(hit),
                **stages,
                "batch_timeline_ms": timeline,
                "client_cpu_s_per_gb": cpu_client / (nbytes_total / 1e9),
                "client_cpu_s_per_gb_by_thread": {
                    name: s / (nbytes_total / 1e9) for name, s in by_thread.most_common()
                    if s > 0},
                "client_cpu_us_per_expert_by_step": step_cpu,
                "agent_cpu_s_per_gb": sum(agent_threads.values()) / (nbytes_total / 1e9),
                "agent_cpu_s_per_gb_by_thread": {
                    name: s / (nbytes_total / 1e9) for name, s in agent_threads.most_common()
                    if s > 0},
                "engine_cpu_s_per_gb": cpu_engine / (nbytes_total / 1e9),
                "delivery": delivery,
            }
            result["mechanism"] = ("dma_engine" if delivery == "engine" else
                                   getattr(device, "mechanism", "cpu-reference"))
            result["mechanism_probe"] = getattr(device, "probe", {})
            if gpu:
                arena_gbps = copy_engine_from_arena(
                    device, client.arena.region_id, half * model.expert_bytes, repeats)
                if arena_gbps is not None:
                    result["copy_engine_arena_gbps"] = arena_gbps
                log(f"{name}: copy engine done")
        finally:
            client.close()
    result.update({f"{k}_gbps": v for k, v in
                   baselines(half * model.expert_bytes, repeats, gpu).items()})
    return result


def plot(results: dict[str, dict[str, object]], path: Path) -> None:
    """Bandwidth against expert size for each path of a results object."""
    series: dict[str, list[tuple[float, float]]] = {}
    for name, r in results.items():
        size = float(r["expert_bytes"]) / 1e6  # type: ignore[arg-type]
        mech = name.split("/")[1] if "/" in name else f"auto ({r['mechanism']})"
        series.setdefault(f"agent + {mech}", []).append((size, float(r["agent_delivery_gbps"])))
        if "/" not in name:
            for base in ("pinned_h2d", "pageable_h2d", "http_staged"):
                if f"{base}_gbps" in r:
                    series.setdefault(base, []).append((size, float(r[f"{base}_gbps"])))
    fig, ax = figure(size=(6.5, 4))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if "agent" in label else "x--",
                label=label)
    ax.set(xscale="log", yscale="log", xlabel="expert size (MB)", ylabel="GB/s",
           title="arena -> GPU delivery vs baselines")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shape only, few repeats")
    ap.add_argument("--experts", type=positive, default=16)
    ap.add_argument("--repeats", type=positive, default=6)
    ap.add_argument("--chunk-bytes", type=positive, default=1 << 20)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES))
    ap.add_argument("--mechanisms", nargs="+", default=["auto"],
                    choices=["auto", "kernel", "copy_engine", "engine"],
                    help="engine: the agent's DMA-engine process delivers, the device verifies")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of a results JSON")
    ap.add_argument("--trace", type=Path, metavar="DIR",
                    help="time each call of the data path in every process (client, agent, "
                         "DMA engine) into DIR (print with bench/trace_report.py); the run's "
                         "figures are printed, not saved: tracing slows them")
    args = ap.parse_args()
    keep_off_agent_cpus()
    if args.experts < 2:
        ap.error(f"--experts: at least 2 (a batch is half of them), got {args.experts}")
    if args.chunk_bytes % 16:
        ap.error(f"--chunk-bytes: a multiple of 16, got {args.chunk_bytes}")
    if args.trace:
        from bench.tracing.sitecustomize import install

        args.trace.mkdir(parents=True, exist_ok=True)
        install(str(args.trace.resolve()))
    if args.replot:
        data = json.loads(args.replot.read_text())
        plot(data["results"], args.replot.with_suffix(".png"))
        return 0
    shapes = args.shapes or (["small-4.7MB"] if args.quick else list(SHAPES))
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-delivery-") as tmp:
        for name in shapes:
            for mech in args.mechanisms:
                key = name if mech == "auto" else f"{name}/{mech}"
                r = results[key] = run_shape(name, args.device, args.experts, args.repeats,
                                             Path(tmp), args.chunk_bytes, mech)
                print(f"{key:<32} {r['mechanism']:<12} {r['agent_delivery_gbps']:6.2f} GB/s "
                      f"pinned {r.get('pinned_h2d_gbps', float('nan')):6.2f}  "
                      f"pageable {r.get('pageable_h2d_gbps', float('nan')):6.2f}  http "
                      f"{r['http_staged_gbps']:6.2f}  p50 {r['acquire_to_ready_p50_ms']:7.3f} ms "
                      f"p99 {r['acquire_to_ready_p99_ms']:7.3f} ms (acquire call "
                      f"{r['acquire_rpc_p50_ms']:.3f}; batch {r['acquire_batch_rpc_p50_ms']:.3f})"
                      f" grant {r['acquire_to_grant_p50_ms']:.3f} ms"
                      f" hit {r['ready_hit_p50_us']:.0f} us"
                      f" ({r['ready_hit_pinned_fraction']:.0%} pinned)"
                      f" | spinning: grant {r['stage_grant_p50_ms']:.3f} landed "
                      f"{r['stage_landed_p50_ms']:.3f} ready {r['stage_ready_p50_ms']:.3f} ms"
                      f" (agent: requests waited {r.get('agent_request_wait_us', 0):.0f} us,"
                      f" served in {r.get('agent_request_service_us', 0):.0f} us; acquires"
                      f" parked for a landing slot {r.get('parked_acquires_per_batch', 0):.1f}"
                      " per batch)"
                      f"  cpu client {r['client_cpu_s_per_gb']:.4f} agent "
                      f"{r['agent_cpu_s_per_gb']:.4f} engine {r['engine_cpu_s_per_gb']:.4f} s/GB"
                      f" (client threads: " + ", ".join(
                          f"{n} {v:.4f}" for n, v in
                          list(r["client_cpu_s_per_gb_by_thread"].items())[:4]) + "; agent "
                      "threads: " + ", ".join(
                          f"{n} {v:.4f}" for n, v in
                          list(r.get("agent_cpu_s_per_gb_by_thread", {}).items())[:4]) + ";"
                      " the calling thread's CPU per expert: " + ", ".join(
                          f"{n} {v:.0f} us" for n, v in
                          r["client_cpu_us_per_expert_by_step"].items()) + ")",
                      file=sys.stderr)
                line = r["batch_timeline_ms"]
                print("  a batch, ms from its post (p50 per expert): " + "; ".join(
                    f"{stage} " + " ".join(f"{t:.2f}" for t in line[stage])
                    for stage in ("grant", "landed", "ready", "end")), file=sys.stderr)
    if args.trace:
        print(f"traced into {args.trace}: python bench/trace_report.py {args.trace}")
        return 0
    data = envelope("delivery", results, device=args.device,
                    command=" ".join(["python", "bench/delivery.py", *sys.argv[1:]]),
                    repeats=args.repeats)
    suffix = f"-{args.device}" + ("" if args.chunk_bytes == 1 << 20
                                  else f"-chunk{args.chunk_bytes >> 10}k")
    path = write("delivery", data, suffix)
    plot(results, path.with_suffix(".png"))
    if args.json:
        print(json.dumps(data))
    else:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
