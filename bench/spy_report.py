"""What a py-spy recording says, in a few tables: the samples each thread took, the frames
they sat in (leaf frames), and, with ``--under``, the call paths below one function.

    python bench/spy_report.py gpu-logs/spy-agent.txt [--thread dataplane]
        [--under acquire_batch] [--depth 4] [--top 15]

Reads ``py-spy record --threads --format raw`` output (plain or gzip): one stack a line,
frames root first separated by ``;``, the first the thread, the sample count last. With
``--idle`` recordings a thread's waits count as samples too: a blocking call's frame is time
spent waiting, not CPU. ``scripts/gpu_check.sh``'s ``spy`` stage writes such files and this
report of each beside them.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path


def stacks(path: Path) -> Iterator[tuple[list[str], int]]:
    """(frames, root first with the thread's first; samples) for each line of ``path``."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                raise ValueError(f"{path}:{n}: not py-spy raw output (frames;... count)")
            yield stack.split(";"), int(count)


def short(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``fn (file.py:12)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def _named(frame: str, name: str) -> bool:
    """Whether ``frame`` is function ``name`` (``fn`` or ``Class.fn``)."""
    qualified = frame.partition(" (")[0]
    return qualified == name or qualified.endswith("." + name)


def report(path: Path, thread: str = "", under: str = "", depth: int = 4,
           top: int = 15) -> str:
    """The tables for ``path``: every thread; leaf frames and the paths below ``under`` of
    the threads whose name contains ``thread``."""
    threads: Counter[str] = Counter()
    leaves: Counter[tuple[str, str]] = Counter()
    below: Counter[str] = Counter()
    total = chosen = 0
    for frames, count in stacks(path):
        total += count
        threads[frames[0]] += count
        if thread not in frames[0]:
            continue
        chosen += count
        leaves[frames[0], short(frames[-1])] += count
        if under:
            at = next((i for i, f in enumerate(frames[1:], 1) if _named(f, under)), None)
            if at is not None:
                below[" > ".join(short(f) for f in frames[at:at + depth])] += count

    def share(n: int, of: int) -> str:
        return f"{n:8d} {100 * n / max(of, 1):5.1f} %"

    out = [f"{path.name}: {total} samples", "", "samples by thread:"]
    out += [f"{share(n, total)}  {name}" for name, n in threads.most_common(top)]
    out += ["", f"leaf frames{f' of threads matching {thread!r}' if thread else ''} "
                f"({chosen} samples):"]
    out += [f"{share(n, chosen)}  {name[:40]:40s} {leaf}"
            for (name, leaf), n in leaves.most_common(top)]
    if under:
        inside = sum(below.values())
        out += ["", f"below {under!r}: {inside} samples ({100 * inside / max(chosen, 1):.1f} %"
                    " of those)"]
        out += [f"{share(n, inside)}  {path_}" for path_, n in below.most_common(top)]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path, help="py-spy record --format raw output (or .gz)")
    ap.add_argument("--thread", default="", help="only threads whose name contains this")
    ap.add_argument("--under", default="",
                    help="a function (fn or Class.fn): the call paths below it")
    ap.add_argument("--depth", type=int, default=4, help="frames shown of each path (>= 1)")
    ap.add_argument("--top", type=int, default=15, help="rows a table shows (>= 1)")
    args = ap.parse_args()
    for name in ("depth", "top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    try:
        print(report(args.file, args.thread, args.under, args.depth, args.top))
    except (OSError, ValueError) as exc:
        print(f"spy_report: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
