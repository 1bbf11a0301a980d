"""Print the per-call timing a traced benchmark run wrote (bench/tracing/sitecustomize.py):
per process and function, calls, wall time p50 / p90 / mean and thread CPU time p50 / mean
(microseconds), and any traced name that no longer exists.

Usage: python bench/trace_report.py DIR
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    args = ap.parse_args()
    files = sorted(args.dir.glob("trace-*.json"))
    if not files:
        print(f"no trace files in {args.dir}", file=sys.stderr)
        return 1
    for f in files:
        print("\n".join(table(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
