"""Replay a routing trace through the weight cache's eviction policies.

Per cache size (in experts): hit rate of every policy in ``POLICIES`` (LRU, LFU, the
routing-aware and the learned-reuse policy; the default one also without routing reported,
``reuse_unreported``), of Belady's MIN (the offline optimum, as the
ceiling) and of a MIN that foresees one token (the ceiling of policies that predict each
layer's next visit), and each policy's own time per access. Each step's distinct experts are
accessed together (they cannot evict each other); the step is then reported to the policies as
routing statistics, as clients do with ReportRouting. Trace format: docs/LAYOUT.md.

Usage:
  python bench/cache_policies.py --trace FILE [--cache-experts N ...] [--json] [--plot PNG]
  python bench/cache_policies.py --generate LAYERS EXPERTS TOPK TOKENS ...   (shipped generator)
  add --prefetch K ... to replay the default policy with next-layer prefetch of K experts
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, envelope, figure, save_figure, trace_path, write
from dpu_agent.config import AgentConfig
from dpu_agent.planning.prediction import NextLayerPredictor
from dpu_agent.routing.stats import RoutingStats
from dpu_agent.routing.traces import RoutingStep, generate_trace, read_trace
from dpu_agent.weights.policies import POLICIES, Evictable, make_policy
from dpu_offload.cli_args import positive
from dpu_offload.keys import ExpertKey

MODEL = "trace"
DEFAULT_POLICY = AgentConfig().cache.policy
UNREPORTED = f"{DEFAULT_POLICY}_unreported"
"""The default policy's row replayed without ReportRouting (it sees only acquires)."""


def replay(steps: list[RoutingStep], policy_name: str, size: int, prefetch: int = 0,
           report: bool = True) -> dict[str, float]:
    """Replay ``steps`` through a cache of ``size`` experts evicting by ``policy_name``; each
    step reported to the policy as routing unless ``report`` is false (a client that does not
    call ReportRouting: the policy sees only acquires); with ``prefetch`` (needs ``report``),
    after each step the ``prefetch`` experts :class:`NextLayerPredictor` expects the next MoE
    layer to select are fetched too (as ReportRouting with ``prefetch_top_k`` does). Returns
    ``ready``: the fraction of needed experts resident when their step starts (the hit rate
    without prefetch), ``wasted``: the fraction of prefetched experts evicted before any use,
    ``prefetched_per_step``, and ``policy_s_per_access``: the time of every call into the
    policy, per needed expert, of which ``data_path_s_per_access`` the calls an acquire makes
    (access, evict, insert: the agent's data-plane loop) and ``observe_s_per_access`` the
    policy's update from each routing observation (ReportRouting, on the agent's control
    thread); beside it, ``fold_s_per_access``: folding each step into the agent's routing
    statistics, which the agent does whatever its policy (the predictor and the planner read
    them)."""
    stats = RoutingStats()
    policy = make_policy(policy_name, stats)
    predictor = NextLayerPredictor(stats)
    resident: set[ExpertKey] = set()
    idle: Evictable[None] = Evictable(policy)  # resident, not in use (as the agent's arena)
    unused: set[ExpertKey] = set()
    need = ready = fetched = wasted = 0
    spent = observing = folding = 0.0
    clock = time.perf_counter

    def admit(key: ExpertKey) -> bool:
        """Make room for ``key`` (evicting an idle expert) and hold it; False when none is idle
        (the step alone overfills the cache: served uncached)."""
        nonlocal wasted, spent
        t0 = clock()
        try:
            if len(resident) >= size:
                taken = idle.evict(key)
                if taken is None:
                    return False
                victim = taken[0]
                resident.discard(victim)
                if victim in unused:
                    unused.discard(victim)
                    wasted += 1
            resident.add(key)
            return True
        finally:
            spent += clock() - t0

    def mark(keys: list[ExpertKey], in_use: bool) -> None:
        """Resident ``keys`` held (not evictable until let go) or let go (idle again, and a
        use for the policy)."""
        nonlocal spent
        t0 = clock()
        for key in keys:
            if in_use:
                idle.discard(key)
            else:
                idle.add(key, None)
        spent += clock() - t0

    for step in steps:
        want = {ExpertKey(MODEL, step.layer, e) for e in step.experts}
        # The step's resident experts are held before its misses evict (a batch's hits are
        # pinned first), and all of them until its layer is done with them.
        held = sorted(want & resident)
        need += len(want)
        ready += len(held)
        unused -= want
        mark(held, in_use=True)
        held += [key for key in sorted(want - resident) if admit(key)]
        if report:
            counts: dict[int, int] = defaultdict(int)
            for e in step.experts:
                counts[e] += 1
            t0 = clock()
            visit = stats.observe(MODEL, step.layer, counts)
            t1 = clock()
            policy.observe(visit)
            observing += clock() - t1
            folding += t1 - t0
        ahead: list[ExpertKey] = []
        if report and prefetch:  # the agent prefetches while the step's bytes still land
            nxt, guess = predictor.predict(MODEL, prefetch)
            wanted = [ExpertKey(MODEL, nxt, e) for e in sorted(guess)]
            ahead = [key for key in wanted if key in resident and key not in held]
            mark(ahead, in_use=True)  # each copied to the device from the arena: pinned meanwhile
            for key in wanted:
                if key in resident:
                    continue
                if not admit(key):
                    break
                ahead.append(key)
                unused.add(key)
                fetched += 1
        mark(sorted(held), in_use=False)
        mark(ahead, in_use=False)
    return {"ready": ready / max(1, need), "wasted": wasted / max(1, fetched),
            "prefetched_per_step": fetched / max(1, len(steps)),
            "policy_s_per_access": (spent + observing) / max(1, need),
            "data_path_s_per_access": spent / max(1, need),
            "observe_s_per_access": observing / max(1, need),
            "fold_s_per_access": folding / max(1, need)}


def simulate(steps: list[RoutingStep], policy_name: str, size: int, report: bool = True
             ) -> tuple[float, float, float, float]:
    """(hit rate, the policy's own time per access in seconds, of which on the data path, the
    routing fold's time per access) of one policy at one cache size, demand fetches only;
    ``report``: as :func:`replay`'s."""
    r = replay(steps, policy_name, size, report=report)
    return (r["ready"], r["policy_s_per_access"], r["data_path_s_per_access"],
            r["fold_s_per_access"])


def simulate_min(steps: list[RoutingStep], size: int, horizon: int | None = None) -> float:
    """Belady's MIN: evict the resident expert whose next use is furthest in the future.

    With ``horizon`` (steps), a MIN that foresees only that far: next uses beyond it are
    unknown, and such experts go first, the least used so far first (LFU). With a horizon of
    one token (the model's MoE layers) it knows exactly what each layer's next visit selects,
    which is all an online policy that predicts the next visit could learn: its hit rate is
    that kind of policy's ceiling."""
    accesses = [[(s.layer, e) for e in sorted(set(s.experts))] for s in steps]
    next_use: list[list[int]] = []
    upcoming: dict[tuple[int, int], int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use.append([upcoming.get(k, 1 << 60) for k in accesses[i]])
        for k in accesses[i]:
            upcoming[k] = i
    next_use.reverse()
    resident: dict[tuple[int, int], int] = {}
    uses: dict[tuple[int, int], int] = defaultdict(int)
    far = 1 << 60 if horizon is None else horizon

    def rank(key: tuple[int, int], now: int) -> tuple[int, int]:
        nxt = resident[key]
        return (nxt, 0) if nxt - now <= far else (1 << 61, -uses[key])

    hits = total = 0
    for i, keys in enumerate(accesses):
        current = set(keys)
        for k, nxt in zip(keys, next_use[i], strict=True):
            total += 1
            uses[k] += 1
            if k in resident:
                hits += 1
            elif len(resident) >= size:
                victim = max((r for r in resident if r not in current),
                             key=partial(rank, now=i), default=None)
                if victim is None:
                    continue
                del resident[victim]
            resident[k] = nxt
    return hits / max(1, total)


def run(steps: list[RoutingStep], sizes: list[int], prefetch: list[int]) -> dict[str, object]:
    """Hit rates per policy and size (MIN as the ceiling), each policy's mean time per access
    (microseconds) and its hit rate relative to MIN averaged over the sizes; with
    ``prefetch`` (experts per step), the default policy with next-layer prefetch per size."""
    for name in POLICIES:  # compiled code loaded (or compiled) before anything is timed
        replay(steps[:256], name, sizes[0])
    rates: dict[str, list[float]] = {}
    cost: dict[str, float] = {}
    data_path: dict[str, float] = {}
    fold: list[float] = []
    for name in POLICIES:
        hits, costs, paths, folds = zip(*(simulate(steps, name, s) for s in sizes),
                                        strict=True)
        rates[name] = list(hits)
        cost[name] = sum(costs) / len(costs) * 1e6
        data_path[name] = sum(paths) / len(paths) * 1e6
        fold += [f * 1e6 for f in folds]
    rates[UNREPORTED] = [simulate(steps, DEFAULT_POLICY, s, report=False)[0] for s in sizes]
    rates["min"] = [simulate_min(steps, s) for s in sizes]
    layers = len({s.layer for s in steps})
    rates["min_one_token"] = [simulate_min(steps, s, layers) for s in sizes]
    of_min = {name: sum(r / m for r, m in zip(rates[name], rates["min"], strict=True) if m)
              / len(sizes) for name in [*POLICIES, UNREPORTED, "min_one_token"]}
    ahead = {str(k): [replay(steps, DEFAULT_POLICY, s, k) for s in sizes] for k in prefetch}
    return {"sizes": sizes, "distinct_experts": len({(s.layer, e) for s in steps
                                                     for e in s.experts}),
            "hit_rate": rates, "policy_us_per_access": cost,
            "data_path_us_per_access": data_path,
            "fold_us_per_access": sum(fold) / len(fold),
            "mean_fraction_of_min": of_min, "prefetch_policy": DEFAULT_POLICY,
            "prefetch": ahead}


def plot(result: dict[str, object], title: str, path: Path) -> None:
    fig, ax = figure()
    for name, rates in result["hit_rate"].items():  # type: ignore[union-attr]
        ax.plot(result["sizes"], rates, marker="o", label=name,  # type: ignore[arg-type]
                linestyle={"min": "--", "min_one_token": ":"}.get(name, "-"))
    ax.set_xlabel("cache size (experts)")
    ax.set_ylabel("hit rate")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=trace_path)
    src.add_argument("--generate", nargs=4, type=positive,
                     metavar=("LAYERS", "EXPERTS", "TOPK", "TOKENS"))
    ap.add_argument("--cache-experts", nargs="+", type=positive)
    ap.add_argument("--json", action="store_true", help="print the result object only")
    ap.add_argument("--plot", type=Path, help="PNG path (default bench/results/cache-NAME.png)")
    ap.add_argument("--prefetch", nargs="*", type=positive, default=[], metavar="K",
                    help="also replay with next-layer prefetch of K experts per step")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.trace:
        steps, name = read_trace(args.trace), args.trace.stem
    else:
        layers, experts, top_k, tokens = args.generate
        if min(layers, experts, top_k, tokens) <= 0 or top_k > experts:
            ap.error("--generate needs positive LAYERS EXPERTS TOPK TOKENS with TOPK <= EXPERTS")
        steps = list(generate_trace(layers, experts, top_k, tokens))
        name = f"generated-{layers}x{experts}-top{top_k}"
    distinct = len({(s.layer, e) for s in steps for e in s.experts})
    sizes = args.cache_experts or sorted({max(1, distinct * f // 16) for f in (2, 4, 6, 8, 12)})
    if any(s <= 0 for s in sizes):
        ap.error("--cache-experts must be positive")
    if any(k <= 0 for k in args.prefetch):
        ap.error("--prefetch K must be positive")
    result = run(steps, sizes, args.prefetch)
    if args.json:
        print(json.dumps(result))
    else:
        for i, s in enumerate(sizes):
            print(f"{name} size {s:4d}: " + "  ".join(
                f"{p} {r[i]:.3f}" for p, r in result["hit_rate"].items()))
        print(f"{name} mean of MIN: " + "  ".join(
            f"{p} {v:.3f}" for p, v in result["mean_fraction_of_min"].items()))
        print(f"{name} policy us per access (of which on the data path): " + "  ".join(
            f"{p} {v:.1f} ({result['data_path_us_per_access'][p]:.1f})"
            for p, v in result["policy_us_per_access"].items())
            + f"; routing fold {result['fold_us_per_access']:.1f} us per access")
        for k, runs in result["prefetch"].items():
            print(f"{name} prefetch {k}/step: " + "  ".join(
                f"size {s}: ready {r['ready']:.3f} wasted {r['wasted']:.2f}"
                for s, r in zip(sizes, runs, strict=True)))
    if not args.no_save:
        write("cache", envelope("cache_policies", result, trace=name, steps=len(steps),
                                command=" ".join(["python", "bench/cache_policies.py",
                                                  *sys.argv[1:]])), f"-{name}")
        plot(result, f"{name}: hit rate vs cache size",
             args.plot or RESULTS / f"cache-{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
