"""docs/PERFORMANCE.md rows of the control-plane benchmarks: the cache policies,
placement, rebalance, the cluster, load and the agent on Arm (bench/report.py)."""

from __future__ import annotations

from typing import Any

from bench.report_rows import Row


def cache(d: dict[str, Any]) -> list[Row]:
    """Issue 24's targets for the agent's default policy (the learned-reuse one; older results
    have the routing-aware one): above LRU and LFU at every size (a size where every policy
    equals MIN cannot be beaten and counts as met), >= 0.85 of MIN averaged over the sizes,
    <= 5 us of policy time per access."""
    r, rows = d["results"], []
    rates = r["hit_rate"]
    name = "reuse" if "reuse" in rates else "routing"
    for i, size in enumerate(r["sizes"]):
        ours, best = rates[name][i], max(rates["lru"][i], rates["lfu"][i])
        mn = rates["min"][i]
        rows.append((f"{d['trace']}: {name} hit rate at {size} experts", f"{ours:.3f}",
                     f"LRU {rates['lru'][i]:.3f} / LFU {rates['lfu'][i]:.3f} / MIN {mn:.3f}",
                     f"{ours / mn:.2f} of MIN" if mn else "-", "> LRU, LFU",
                     ours > best or ours >= mn))
    of_min = r.get("mean_fraction_of_min", {}).get(name)
    if of_min is not None:
        rows.append((f"{d['trace']}: {name} hit rate / MIN, mean over sizes", f"{of_min:.3f}",
                     f"LRU {r['mean_fraction_of_min']['lru']:.3f} / LFU "
                     f"{r['mean_fraction_of_min']['lfu']:.3f}", "", ">= 0.85", of_min >= 0.85))
    foresight = r.get("mean_fraction_of_min", {}).get("min_one_token")
    if foresight is not None:
        rows.append((f"{d['trace']}: ceiling of a next-visit predictor (MIN foreseeing one "
                     "token), / MIN, mean over sizes", f"{foresight:.3f}", "", "", "", None))
    quarter = min(range(len(r["sizes"])),  # the size nearest a 25 % cache
                  key=lambda i: abs(4 * r["sizes"][i] - r.get("distinct_experts", 0)))
    for k, runs in r.get("prefetch", {}).items():
        got, mn = runs[quarter], rates["min"][quarter]
        rows.append((f"{d['trace']}: ready when needed, {r['prefetch_policy']} + next-layer "
                     f"prefetch of {k} per step, {r['sizes'][quarter]} experts",
                     f"{got['ready']:.3f} ({got['prefetched_per_step']:.3g} prefetched per "
                     f"step, {got['wasted']:.0%} of them wasted)",
                     f"MIN demand {mn:.3f}", f"{got['ready'] / mn:.2f} of MIN" if mn else "-",
                     "> MIN, < 50 % wasted", got["ready"] > mn and got["wasted"] < 0.5))
    cost = r.get("policy_us_per_access", {}).get(name)
    if cost is not None:
        data_path = r.get("data_path_us_per_access", {}).get(name)
        split = "" if data_path is None else f" ({data_path:.1f} us on the data path)"
        rows.append((f"{d['trace']}: {name} policy time per access", f"{cost:.1f} us{split}",
                     f"LRU {r['policy_us_per_access']['lru']:.1f} us", "", "<= 5 us",
                     cost <= 5.0))
        fold = r.get("fold_us_per_access")
        if fold is not None:
            rows.append((f"{d['trace']}: folding routing into the agent's statistics, per "
                         "access (every policy)", f"{fold:.1f} us",
                         f"with the {name} policy {cost + fold:.1f} us", "", "", None))
    return rows


def placement(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for c in d["results"]["cases"]:
        tag = f"{c['gpus']} GPUs + {c['replicas']} replicas"
        rows.append((f"placement balance, {tag}", f"{c['max_load_ratio']:.3f}",
                     f"LPT {c['lpt_max_load_ratio']:.3f}", f"{c['balance_vs_lpt']:.3f}x",
                     "<= 1.02x", c["balance_vs_lpt"] <= 1.02))
        rows.append((f"bytes per rebalance, {tag}", f"{c['bytes_moved'] / 1e9:.1f} GB",
                     f"from scratch {c['scratch_bytes_moved'] / 1e9:.1f} GB",
                     f"{c['moved_vs_scratch']:.2f}x", "<= 0.5x", c["moved_vs_scratch"] <= 0.5))
        limit = 50 if c["gpus"] <= 8 else 500
        rows.append((f"planning time, {tag} (first / rebalance)",
                     f"{c['plan_ms']:.0f} / {c['rebalance_ms']:.0f} ms", "", "",
                     f"<= {limit} ms", max(c["plan_ms"], c["rebalance_ms"]) <= limit))
    return rows


def rebalance(d: dict[str, Any]) -> list[Row]:
    r = d["results"]
    b = r["rebalance"]
    return [("rebalance, ApplyPlacement to verified", f"{b['apply_to_verified_s'] * 1e3:.0f} ms",
             f"bytes / measured bandwidth {b['bound_s'] * 1e3:.0f} ms",
             f"{b['ratio_to_bound']:.2f}x", "", None),
            ("routing-driven prefetch, hit rate", f"{r['prefetch_on']['hit_rate']:.3f}",
             f"without {r['prefetch_off']['hit_rate']:.3f}",
             f"+{r['prefetch_hits_gained']} hits, {r['prefetch_extra_bytes'] / 1e6:.0f} MB extra",
             "", None)]


def cluster(d: dict[str, Any]) -> list[Row]:
    r = d["results"]
    p, s = r["peers"], r["storage"]
    return [("rebalance 3 -> 4 agents, placement written to all converged",
             f"{p['rebalance_converge_s'] * 1e3:.0f} ms",
             f"storage only {s['rebalance_converge_s'] * 1e3:.0f} ms",
             f"{r['rebalance_speedup_vs_storage']:.2f}x", "", None),
            ("bytes moved by the rebalance (share from peers)",
             f"{p['bytes_moved'] / 1e6:.1f} MB ({p['peer_share']:.0%})",
             f"{s['bytes_moved'] / 1e6:.1f} MB ({s['peer_share']:.0%})", "", "", None),
            ("etcd operations per rebalance (all agents + planner)",
             f"{p['etcd_ops_per_rebalance']:.0f}", f"{s['etcd_ops_per_rebalance']:.0f}", "", "",
             None),
            (f"agent killed to its experts held again (lease {p['lease_seconds']} s)",
             f"{p['kill_to_replaced_s']:.1f} s", "", "", "", None)]


def load_bench(d: dict[str, Any]) -> list[Row]:
    r = d["results"]
    return [(f"load: {r['clients']} clients, {r['seconds']:.0f} s",
             f"{r['requests']} cycles, p99 {r['p99_ms']:.0f} ms", "",
             f"RSS {r['rss_growth_late_vs_early']:+.1%}", "0 errors, 0 deadlocks",
             r["errors"] == 0 and r["deadlocks"] == 0)]


def arm64(d: dict[str, Any]) -> list[Row]:
    r = d["results"]
    arm, x86 = r["aarch64_under_qemu"], r["native_x86_64"]
    return [("agent start-up, aarch64 under qemu", f"{arm['startup_s']:.1f} s",
             f"native {x86['startup_s']:.2f} s", f"{r['startup_ratio']:.0f}x", "", None),
            ("agent first start (Numba compiles), aarch64 under qemu",
             f"{arm['startup_cold_s']:.0f} s", f"native {x86['startup_cold_s']:.1f} s",
             f"{r['cold_startup_ratio']:.0f}x", "", None),
            ("agent CPU per GB, aarch64 under qemu",
             f"{arm['agent_cpu_s_per_gb']:.2f} s", f"native {x86['agent_cpu_s_per_gb']:.2f} s",
             f"{r['cpu_per_gb_ratio']:.1f}x", "", None)]
