"""The agent's cost of finding a slot for a delivery (``SlotPool.allocate``), against the
pool's size: a decode with a cache smaller than the model keeps its pools full, so every miss
evicts an idle slot; a pool of 1,536 slots is Qwen3-30B-A3B's 48 layers x 128 experts at a 25 %
cache. The baseline in the same run is a dictionary lookup (the agent's cost of a hit), the
floor of any per-request work.

    python bench/slot_pool.py [--sizes 64 256 1536 4096] [--calls 2000] [--no-save]

Reported per size, microseconds per call: ``fill`` (allocating into a pool with free slots,
lowest first) and ``evict`` (the pool full, every slot idle: the pool's eviction policy names
the victim), with the agent's default policy (``reuse``, no routing reported: every expert
equally likely, so the layer furthest from its next visit goes) and with LRU
(``evict_lru``); and ``batch`` / ``batch_lru``: per acquire of a decode at batch > 1, where
each layer's ``--batch`` experts (hits and misses) are all held while the misses evict, then
released (layers of 128 experts, random routing).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, write
from dpu_agent.config import AgentConfig
from dpu_agent.routing.stats import RoutingStats
from dpu_agent.slots import SlotPool
from dpu_agent.weights.policies import make_policy
from dpu_agent.weights.reuse import warm_up
from dpu_offload.cli_args import positive
from dpu_offload.keys import ExpertKey


def measure(slots: int, calls: int, policy: str) -> dict[str, float]:
    """Microseconds per ``allocate`` filling a pool of ``slots`` and then evicting from it
    (``calls`` evictions; each slot filled, READY and released, as a decode leaves them), and
    per dictionary lookup of a held key."""
    keys = [ExpertKey("m", i // 128, i % 128) for i in range(slots + calls)]
    stats = RoutingStats()
    stats.declare("m", range(keys[-1].layer + 1), 128)  # as LoadModel does
    pool = SlotPool(1, 4096, slots, policy=make_policy(policy, stats))

    def fill(batch: list[ExpertKey]) -> float:
        t0 = time.perf_counter()
        for key in batch:
            idx = pool.allocate(key)
            assert idx is not None
            pool.mark_ready(idx)
            pool.let_go(idx)
        return (time.perf_counter() - t0) / len(batch)

    filling = fill(keys[:slots])
    evict = fill(keys[slots:])
    held = keys[slots + calls - 1]
    t0 = time.perf_counter()
    for _ in range(calls):
        pool.by_key.get(held)
    lookup = (time.perf_counter() - t0) / calls
    return {"fill_us": filling * 1e6, "evict_us": evict * 1e6, "lookup_us": lookup * 1e6}


def hold_layer(pool: SlotPool, keys: list[ExpertKey]) -> list[int]:
    """One MoE layer's experts all held, as a decode step holds them: a hit's slot held, a
    miss's allocated (evicting as the pool's policy names) and made READY; returns the slots,
    still held."""
    slots = []
    for key in keys:
        idx = pool.by_key.get(key)
        if idx is None:
            idx = pool.allocate(key)
            assert idx is not None, f"no slot for {key}: every slot is held"
            pool.mark_ready(idx)
        else:
            pool.hold(idx)
        slots.append(idx)
    return slots


def measure_batch(slots: int, calls: int, policy: str, batch: int, homes: bool = False
                  ) -> float:
    """Microseconds per acquire (a hit's hold or a miss's allocate) when each layer's
    ``batch`` distinct experts of 128, chosen at random, are all held before any is released,
    over ``calls`` acquires after the pool first filled; with ``homes``, the pool cut into one
    home per layer (where the layers divide it)."""
    stats = RoutingStats()
    layers = max(2, -(-2 * slots // 128))  # the model twice the pool
    stats.declare("m", range(layers), 128)
    pool = SlotPool(1, 4096, slots, policy=make_policy(policy, stats),
                    home_layers=tuple(range(layers)) if homes and slots % layers == 0 else ())
    rng = random.Random(0)
    spent, timed, filled, layer = 0.0, 0, 0, 0
    while timed < calls:
        keys = [ExpertKey("m", layer, e) for e in rng.sample(range(128), batch)]
        t0 = time.perf_counter()
        held = hold_layer(pool, keys)
        if filled >= slots:
            spent += time.perf_counter() - t0
            timed += batch
        filled += batch
        for idx in held:
            pool.let_go(idx)
        layer = (layer + 1) % layers
    return spent / timed * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=positive, nargs="+", default=[64, 256, 1536, 4096])
    ap.add_argument("--calls", type=positive, default=2000)
    ap.add_argument("--batch", type=positive, default=64,
                    help="experts a layer holds at once in the batched case (<= 128)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if min(args.sizes) < 1 or args.calls < 1:
        ap.error("--sizes and --calls must be positive")
    if not 1 <= args.batch <= min(128, min(args.sizes)):
        ap.error("--batch must be in [1, min(128, the smallest size)]")
    warm_up()  # the compiled policy loaded, as the agent does at start
    default = AgentConfig().cache.policy
    results = {}
    for n in args.sizes:
        r = results[str(n)] = measure(n, args.calls, default)
        r["policy"] = default
        r["evict_lru_us"] = measure(n, args.calls, "lru")["evict_us"]
        r["batch"] = args.batch
        r["batch_us"] = measure_batch(n, args.calls, default, args.batch)
        r["batch_lru_us"] = measure_batch(n, args.calls, "lru", args.batch)
        r["batch_homes_us"] = measure_batch(n, args.calls, default, args.batch, homes=True)
        print(f"{n:>5} slots: fill {r['fill_us']:5.1f} us, evict {r['evict_us']:5.1f} us "
              f"({default}; LRU {r['evict_lru_us']:.1f}) per allocate (a lookup "
              f"{r['lookup_us']:.2f} us); batches of {args.batch}: {r['batch_us']:.1f} us "
              f"per acquire (LRU {r['batch_lru_us']:.1f}; a home per layer "
              f"{r['batch_homes_us']:.1f})")
    if not args.no_save:
        data = envelope("slot_pool", results,
                        command="python bench/slot_pool.py " + " ".join(sys.argv[1:]))
        print(f"wrote {write('slot-pool', data, '-cpu')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
