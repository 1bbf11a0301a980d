"""Interleaved A/B runs of one benchmark: two source trees, or two settings of one tree, run
alternately on one machine (VMs differ by tens of percent between each other, so a design is
compared with the one before it only within one machine's run).

    python bench/ab.py prepare REV
        here, with git: the tree at REV into .scratch/ab/REV (carry .scratch to the GPU machine)
    python bench/ab.py run [--a DIR] [--b DIR] [--env-a K=V ...] [--env-b K=V ...]
            [--args-a ARGS] [--args-b ARGS] [--rounds N] [--metric PATH ...]
            -- bench/delivery.py --device cuda ...
        runs the benchmark from each side in turn, ``--rounds`` times; after each run reads the
        results JSON the benchmark wrote in that side's bench/results (the newest) and prints,
        for every results entry (and the results themselves, for a flat record), each
        ``--metric`` (a key of the entry, dotted for nested ones, a number for a list's item:
        ``runs.0.offload.tokens_per_s``) per round and side, then the medians, after every round
        (a run cut short keeps the rounds it finished). Sides default to this tree; ``--env-a``
        / ``--env-b`` set variables for one side only (an agent setting:
        ``DPU_AGENT_TRANSFER_ENGINE_POLL=doze``), ``--args-a`` / ``--args-b`` arguments added
        to the benchmark's for one side only (one string, split as a shell splits it; with
        ``=`` where it starts with a dash: ``--args-b=--host-waits``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_METRICS = ("agent_delivery_gbps", "acquire_to_ready_p50_ms", "client_cpu_s_per_gb",
                   "agent_cpu_s_per_gb")


def prepare(rev: str) -> Path:
    """The tree at ``rev`` (git archive) in .scratch/ab/REV; returns that directory."""
    out = ROOT / ".scratch" / "ab" / rev
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"ab: expected KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _dig(entry: Any, path: str) -> Any:
    """``entry`` at the dotted ``path`` (a number indexes a list), None where it has none."""
    for part in path.split("."):
        if isinstance(entry, list) and part.isdigit() and int(part) < len(entry):
            entry = entry[int(part)]
        elif isinstance(entry, dict) and part in entry:
            entry = entry[part]
        else:
            return None
    return entry


def run_side(tree: Path, command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run the benchmark from ``tree``; the results JSON it wrote there."""
    results = tree / "bench" / "results"
    started = time.time()
    path = os.environ.get("PYTHONPATH", "")
    full_env = {**os.environ, **env,
                "PYTHONPATH": os.pathsep.join(p for p in (str(tree), path) if p)}
    res = subprocess.run([sys.executable, *command], cwd=tree, env=full_env,
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"ab: {' '.join(command)} in {tree} failed:\n{res.stderr[-2000:]}")
    written = [p for p in results.glob("*.json") if p.stat().st_mtime >= started]
    if not written:
        raise SystemExit(f"ab: {' '.join(command)} wrote no results JSON in {results}")
    return json.loads(max(written, key=lambda p: p.stat().st_mtime).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("rev")
    p = sub.add_parser("run")
    p.add_argument("--a", type=Path, default=ROOT)
    p.add_argument("--b", type=Path, default=ROOT)
    p.add_argument("--env-a", action="append", default=[])
    p.add_argument("--env-b", action="append", default=[])
    p.add_argument("--args-a", default="")
    p.add_argument("--args-b", default="")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--metric", action="append", default=[])
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.verb == "run" and args.rounds < 1:
        ap.error(f"--rounds: must be positive, got {args.rounds}")
    if args.verb == "prepare":
        print(prepare(args.rev))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("run: give the benchmark after --")
    try:
        extra = {"A": shlex.split(args.args_a), "B": shlex.split(args.args_b)}
    except ValueError as exc:
        ap.error(f"run: --args-a / --args-b: {exc}")
    if (args.a.resolve() == args.b.resolve() and args.env_a == args.env_b
            and extra["A"] == extra["B"]):
        ap.error("run: the sides are the same tree with the same environment and arguments")
    sides = {"A": (args.a.resolve(), _env(args.env_a)), "B": (args.b.resolve(), _env(args.env_b))}
    metrics = args.metric or list(DEFAULT_METRICS)
    seen: dict[tuple[str, str, str], list[float]] = {}
    for r in range(args.rounds):
        for side, (tree, env) in sides.items():
            data = run_side(tree, command + extra[side], env)
            results = data.get("results", {})
            # A metric is looked up in each entry of the results, and in the results
            # themselves (benchmarks whose results are one flat record).
            entries = {"(results)": results,
                       **{n: e for n, e in results.items() if isinstance(e, dict)}}
            for name, entry in entries.items():
                for metric in metrics:
                    value = _dig(entry, metric)
                    if isinstance(value, int | float):
                        seen.setdefault((name, metric, side), []).append(float(value))
            print(f"round {r + 1} side {side} ({tree.name or tree}, source "
                  f"{data.get('source_hash', '?')}) done", file=sys.stderr)
            if not any(key[2] == side for key in seen):
                print(f"ab: no --metric ({', '.join(metrics)}) is a number in this "
                      f"benchmark's results; their keys: {', '.join(sorted(results))}",
                      file=sys.stderr)
                return 2
        # The table so far after every round: a run cut short by a time limit keeps its rounds.
        print(f"after round {r + 1} of {args.rounds}:\n{table(seen)}", flush=True)
    return 0


def table(seen: dict[tuple[str, str, str], list[float]]) -> str:
    """One line per results entry, metric and side: each round's value, then their median."""
    return "\n".join(f"{name:34s} {metric:28s} {side}: " + " ".join(f"{v:9.4f}" for v in values)
                     + f"   median {statistics.median(values):9.4f}"
                     for (name, metric, side), values in sorted(seen.items()))


if __name__ == "__main__":
    sys.exit(main())
