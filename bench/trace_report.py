"""Print the per-call timing a traced benchmark run wrote (bench/tracing/sitecustomize.py):
per process and function, calls, wall time p50 / p90 / mean and thread CPU time p50 / mean
(microseconds), and any traced name that no longer exists.

Usage: python bench/trace_report.py DIR [--timeline FUNCTION [--window MS]]

``--timeline`` lays out, for the last few calls of FUNCTION (``Class.method`` as traced, e.g.
``AgentClient.acquire_batch``), every traced call of every process that started within the
window after it: start and end in microseconds from the anchor's start, and CPU time (the
processes share CLOCK_MONOTONIC, so their times line up).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def table(path: Path) -> list[str]:
    """The report lines of one process's trace file."""
    body = json.loads(path.read_text())
    lines = [f"== {path.stem.removeprefix('trace-')}"]
    for name, calls in sorted(body["calls"].items()):
        wall = sorted(c[1] for c in calls)
        cpu = sorted(c[2] for c in calls)
        n = len(calls)
        lines.append(f"  {name:34s} n={n:7d}  wall p50 {wall[n // 2] / 1e3:8.1f}  p90 "
                     f"{wall[int(n * 0.9)] / 1e3:8.1f}  mean {sum(wall) / n / 1e3:8.1f} us | cpu "
                     f"p50 {cpu[n // 2] / 1e3:8.1f}  mean {sum(cpu) / n / 1e3:8.1f} us")
    lines += [f"  missing (update TARGETS): {m}" for m in body["missing"]]
    return lines


def timeline(files: list[Path], anchor: str, window_ms: float, last: int) -> list[str]:
    """The report lines of the timelines after the ``last`` calls of ``anchor``."""
    calls: list[tuple[int, int, int, str]] = []
    starts: list[int] = []
    for path in files:
        process = path.stem.removeprefix("trace-")
        for name, rows in json.loads(path.read_text())["calls"].items():
            calls += [(t0, wall, cpu, f"{process} {name}") for t0, wall, cpu in rows]
            if name == anchor:
                starts += [t0 for t0, _, _ in rows]
    if not starts:
        return [f"no call of {anchor} traced"]
    calls.sort()
    lines = []
    for start in sorted(starts)[-last:]:
        lines.append(f"== timeline from {anchor} (us from its start; cpu us)")
        end = start + int(window_ms * 1e6)
        for t0, wall, cpu, who in calls:
            if start <= t0 <= end:
                lines.append(f"  {(t0 - start) / 1e3:9.1f} {(t0 + wall - start) / 1e3:9.1f}"
                             f"  cpu {cpu / 1e3:7.1f}  {who}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--timeline", metavar="FUNCTION",
                    help="lay out every process's calls after each of FUNCTION's last calls")
    ap.add_argument("--window", type=float, default=4.0, help="timeline length, ms")
    ap.add_argument("--last", type=int, default=3, help="how many anchor calls to lay out")
    args = ap.parse_args()
    if not (0 < args.window <= 60_000) or args.last < 1:
        ap.error("--window: above 0 and at most 60000 ms; --last: positive")
    files = sorted(args.dir.glob("trace-*.json"))
    if not files:
        print(f"no trace files in {args.dir}", file=sys.stderr)
        return 1
    if args.timeline:
        print("\n".join(timeline(files, args.timeline, args.window, args.last)))
        return 0
    for f in files:
        print("\n".join(table(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
