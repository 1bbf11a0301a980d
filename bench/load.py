"""Load: many concurrent clients doing acquire / release against a small arena that forces
constant eviction, for a bounded time. Reports RPC latency (acquire to verified slot, p50 /
p99), errors (must be 0), deadlocks (a client without progress for --stall seconds; must be
0) and the agent's resident memory over time (must not grow). --soak runs longer.

A quarter of the clients send activation traffic instead: MoE layer dispatches (8 tokens,
top-2) through the agent's activation router to one expert worker process (`expertctl
serve-experts`) whose device holds every expert, each result checked for shape and finiteness; their
round trips are reported apart from the acquires.

Usage: python bench/load.py [--clients 64] [--seconds 20] [--soak] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.common import envelope, pct, write
from dpu_offload.cli_args import positive
from dpu_offload.cli_args import seconds as duration
from dpu_offload.keys import ExpertKey
from gpu_kernels import reference
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationSender
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess, stop_process

LAYERS, EXPERTS = 4, 32


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run(clients: int, seconds: float, stall: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        root = make_checkpoint(Path(tmp) / "m", CheckpointSpec(
            "qwen3-moe", layers=LAYERS, experts=EXPERTS, hidden=256, intermediate=128))
        # ~80 experts fit the arena, 128 exist: every few acquires evict.
        with AgentProcess('[arena]\nbytes = "16MiB"\n[sessions]\nmax_concurrent_rpcs = 8\n'
                          '[activations]\nlisten_address = "127.0.0.1:0"\n') as agent:
            boot = AgentClient(agent.address)
            model = boot.load_model(str(root), "m")
            # The expert worker is its own process, as a GPU host's would be.
            worker = subprocess.Popen(
                [sys.executable, "-m", "host_client.cli", "serve-experts", "--agent",
                 agent.address, "--checkpoint", str(root), "--model", "m"],
                stdout=subprocess.PIPE, text=True)
            assert worker.stdout is not None and worker.stdout.readline().startswith("ready")
            latencies: list[float] = []
            act_latencies: list[float] = []
            errors: list[str] = []
            progress = [time.monotonic()] * clients
            stop = threading.Event()
            lock = threading.Lock()

            def timed_loop(i: int, who: str, session: Callable[[], Any],
                           into: list[float]) -> None:
                """``session()`` is a context manager yielding one operation to repeat and
                time until stopped; any failure is counted as an error."""
                try:
                    with session() as step:
                        while not stop.is_set():
                            t0 = time.perf_counter()
                            step()
                            dt = time.perf_counter() - t0
                            with lock:
                                into.append(dt)
                            progress[i] = time.monotonic()
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    with lock:
                        errors.append(f"{who} {i}: {type(exc).__name__}: {exc}")

            @contextlib.contextmanager
            def dispatcher(i: int) -> Iterator[Callable[[], None]]:
                rng = np.random.default_rng(i)
                with ActivationSender(f"127.0.0.1:{agent.activations_port}", "m",
                                      EXPERTS) as snd:
                    def step() -> None:
                        x = reference.f32_to_bf16(rng.standard_normal((8, 256), np.float32))
                        ids = np.stack([rng.choice(EXPERTS, 2, replace=False) for _ in range(8)])
                        out = snd.dispatch(int(rng.integers(LAYERS)), x, ids,
                                           np.full((8, 2), 0.5, np.float32))
                        if out.shape != x.shape or not np.isfinite(
                                reference.bf16_to_f32(out)).all():
                            raise ValueError(f"bad combined output {out.shape}")

                    yield step

            @contextlib.contextmanager
            def acquirer(i: int) -> Iterator[Callable[[], None]]:
                rng = random.Random(i)
                with AgentClient(agent.address, client_name=f"load-{i}") as c:
                    dev = c.register_device(CpuReferenceDevice(i),
                                            [SlotPoolSpec(model.expert_bytes, 2)],
                                            ring_capacity=64)

                    def step() -> None:
                        key = ExpertKey("m", rng.randrange(LAYERS), rng.randrange(EXPERTS))
                        c.acquire(dev, key).wait(60)
                        c.release(dev, key)

                    yield step

            def sender(i: int) -> None:
                timed_loop(i, "sender", lambda: dispatcher(i), act_latencies)

            def client(i: int) -> None:
                timed_loop(i, "client", lambda: acquirer(i), latencies)

            threads = [threading.Thread(target=sender if i % 4 == 3 else client, args=(i,),
                                        daemon=True) for i in range(clients)]
            for t in threads:
                t.start()
            samples, deadlocked = [], set()
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                time.sleep(1.0)
                now = time.monotonic()
                samples.append((round(seconds - (t_end - now), 1), rss_bytes(agent.proc.pid)))
                deadlocked |= {i for i, p in enumerate(progress) if now - p > stall}
            stop.set()
            for t in threads:
                t.join(60)
            deadlocked |= {i for i, t in enumerate(threads) if t.is_alive()}
            alive = agent.proc.poll() is None
            if not stop_process(worker, 10):
                raise RuntimeError("the expert worker did not exit within 10 s of SIGTERM "
                                   "(its threads' stacks are in its stderr above)")
            boot.close()
    rss = [r for _, r in samples]
    q = max(1, len(rss) // 4)
    growth = (sum(rss[-q:]) / q) / max(1, sum(rss[q:2 * q]) / q) - 1 if len(rss) >= 4 else 0.0
    return {"clients": clients, "seconds": seconds, "requests": len(latencies),
            "requests_per_second": len(latencies) / seconds,
            "p50_ms": pct(latencies, 50) * 1e3, "p99_ms": pct(latencies, 99) * 1e3,
            "activation_senders": clients // 4, "activation_dispatches": len(act_latencies),
            "activation_p50_ms": pct(act_latencies, 50) * 1e3,
            "activation_p99_ms": pct(act_latencies, 99) * 1e3,
            "errors": len(errors), "error_samples": errors[:5],
            "deadlocks": len(deadlocked), "agent_alive": alive,
            "rss_samples": samples, "rss_growth_late_vs_early": growth}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=positive, default=64)
    ap.add_argument("--seconds", type=duration, default=20.0)
    ap.add_argument("--soak", action="store_true", help="run for 10 minutes")
    ap.add_argument("--stall", type=duration, default=15.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seconds = 600.0 if args.soak else args.seconds
    r = run(args.clients, seconds, args.stall)
    print(f"{r['clients']} clients, {r['seconds']:.0f} s: {r['requests']} acquires "
          f"({r['requests_per_second']:.0f}/s), p50 {r['p50_ms']:.2f} ms, p99 "
          f"{r['p99_ms']:.2f} ms; {r['activation_dispatches']} activation dispatches from "
          f"{r['activation_senders']} senders, p50 {r['activation_p50_ms']:.1f} ms, p99 "
          f"{r['activation_p99_ms']:.1f} ms; errors {r['errors']}, deadlocks "
          f"{r['deadlocks']}, agent RSS growth {r['rss_growth_late_vs_early']:+.1%}",
          file=sys.stderr)
    path = write("load", envelope("load", r, command="python bench/load.py " +
                                  " ".join(sys.argv[1:])), "-soak" if args.soak else "")
    print(json.dumps(r) if args.json else f"wrote {path}")
    ok = r["errors"] == 0 and r["deadlocks"] == 0 and r["agent_alive"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
