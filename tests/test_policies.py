"""Eviction policies against routing traces: the learned-reuse policy learns what a layer's
history says about its next visit, respects the candidates it is given, beats LRU and LFU on
skewed layer-cyclic routing and keeps up with LRU on purely sticky routing (the real traces:
bench/cache_policies.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.cache_policies import replay, simulate
from bench.rebalance import replay_decode
from dpu_agent.planning.prediction import HISTORY_HORIZON, NextLayerPredictor, scores, top
from dpu_agent.routing.stats import (
    FEATURES,
    HALF_LIVES,
    LAST,
    LOAD_HALF_LIFE,
    SHARE,
    LayerStats,
    RoutingStats,
)
from dpu_agent.routing.traces import RoutingStep, generate_trace
from dpu_agent.weights.arena import ARENA_ALIGN
from dpu_agent.weights.catalog import build_catalog
from dpu_agent.weights.policies import POLICIES, LearnedReusePolicy, make_policy
from dpu_agent.weights.reuse import HORIZON_DISCOUNT, HORIZON_STEPS
from dpu_agent.weights.reuse_state import learn
from dpu_offload.blob import align_up
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess
from tests.conftest import assert_prefetched


def _sticky_trace(layers: int, experts: int, tokens: int, stay: float, seed: int = 0
                  ) -> list[RoutingStep]:
    """Top-2 decode where each layer keeps each of its last experts with probability ``stay``
    (the token-to-token locality real routing shows), else picks uniformly."""
    rng = random.Random(seed)
    last = [rng.sample(range(experts), 2) for _ in range(layers)]
    steps = []
    for _ in range(tokens):
        for layer in range(layers):
            pick = [e for e in last[layer] if rng.random() < stay]
            while len(pick) < 2:
                e = rng.randrange(experts)
                if e not in pick:
                    pick.append(e)
            last[layer] = pick
            steps.append(RoutingStep(layer, tuple(pick)))
    return steps


def _reuse_after(steps: list[RoutingStep]) -> LearnedReusePolicy:
    """A learned-reuse policy on its own routing statistics, shown ``steps``."""
    stats = RoutingStats()
    policy = LearnedReusePolicy(stats)
    for step in steps:
        policy.observe(stats.observe("m", step.layer, {e: 1 for e in step.experts}))
    return policy


def test_it_learns_that_an_expert_just_selected_comes_back() -> None:
    steps = _sticky_trace(4, 8, 300, stay=0.8)
    policy = _reuse_after(steps)
    last = set(steps[-1].experts)  # layer 3's last visit
    cold = [e for e in range(8) if e not in last]
    p = {e: policy.predicted(ExpertKey("m", 3, e)) for e in range(8)}
    assert min(p[e] for e in last) > max(p[e] for e in cold) + 0.3


def test_the_victim_is_a_candidate_and_the_layer_far_away_goes_first() -> None:
    policy = _reuse_after(_sticky_trace(4, 8, 50, stay=0.5))
    keys = [ExpertKey("m", layer, e) for layer in range(4) for e in range(2)]
    for key in keys:
        policy.on_insert(key)
    allowed = {k for k in keys if k.layer != 1}
    victim = policy.evict(allowed, ExpertKey("m", 0, 7))
    assert victim in allowed
    assert policy.evict(set(), ExpertKey("m", 0, 7)) is None
    assert policy.evict({victim}, ExpertKey("m", 0, 7)) == victim  # forgotten: still named


def test_a_miss_of_one_model_evicts_another_models_least_likely_expert() -> None:
    """Two models share the arena: when only the other model's experts can go, the victim is
    the one least likely to be selected at its layer's next visit (not any of them)."""
    stats = RoutingStats()
    policy = LearnedReusePolicy(stats)
    for _ in range(40):  # model a's layer 0 selects experts 0-5 at every visit, never 6
        policy.observe(stats.observe("a", 0, {e: 1 for e in range(6)}))
    keys = [ExpertKey("a", 0, e) for e in range(7)]
    for key in keys:
        policy.on_insert(key)
    assert policy.evict(set(keys), ExpertKey("b", 3, 0)) == ExpertKey("a", 0, 6)
    assert policy.evict(set(keys[:6]), ExpertKey("b", 3, 0)) in keys[:6]


def use(policy: LearnedReusePolicy, key: ExpertKey) -> None:
    """``key`` used again, as a cache tells its policy: held (not evictable), then let go."""
    policy.on_remove(key)
    policy.on_insert(key)


def test_without_reported_routing_a_layer_loses_its_least_recently_used_first() -> None:
    """No visit reported (a client that does not report routing): every prediction is the
    same, so in a layer the expert whose last use ended longest ago goes, whatever its number;
    the layer order still decides between layers (the one decode needs last goes first)."""
    policy = LearnedReusePolicy(RoutingStats())
    keys = [ExpertKey("m", 0, e) for e in (5, 1, 3, 0)]
    for key in keys:
        policy.on_insert(key)
    use(policy, keys[0])  # 5 used again: 1 is now the least recently used
    assert policy.evict(set(keys), ExpertKey("m", 0, 7)) == keys[1]
    use(policy, keys[2])  # 3 used: 0 is next, then 5
    assert policy.evict(set(keys) - {keys[1]}, ExpertKey("m", 0, 7)) == keys[3]
    assert policy.evict({keys[0], keys[2]}, ExpertKey("m", 0, 7)) == keys[0]
    for e in (2, 4):
        policy.on_insert(ExpertKey("m", 1, e))
    policy.on_insert(ExpertKey("m", 2, 6))
    # filling layer 1 of the next token: layer 0 comes round in 2 steps, layer 2 in 1
    assert policy.evict({ExpertKey("m", 0, 3), ExpertKey("m", 2, 6)},
                        ExpertKey("m", 1, 0)) == ExpertKey("m", 0, 3)


def test_on_one_layer_without_reported_routing_it_is_lru() -> None:
    """A one-layer trace replayed with no visits reported is LRU's hit rate exactly."""
    steps = list(generate_trace(1, 32, 4, 300, seed=5))
    for size in (8, 16):
        assert simulate(steps, "reuse", size, report=False)[0] == \
            simulate(steps, "lru", size, report=False)[0]


def test_it_beats_lru_and_lfu_on_skewed_drifting_routing() -> None:
    """The shipped generator (Zipf popularity per layer, ranks drifting), layer-cyclic."""
    steps = list(generate_trace(4, 16, 2, 400, seed=3))
    for size in (8, 16, 24):
        rates = {p: simulate(steps, p, size)[0] for p in ("lru", "lfu", "reuse")}
        assert rates["reuse"] > max(rates["lru"], rates["lfu"]), (size, rates)


def test_on_sticky_routing_it_keeps_up_with_lru_where_lfu_cannot() -> None:
    """Routing that repeats the last token's experts (recency is everything): LRU is hard to
    beat at a cache of one token's experts, LFU far behind; below one token LRU thrashes."""
    steps = _sticky_trace(8, 8, 250, stay=0.6)
    for size in (12, 16, 24, 32):
        rates = {p: simulate(steps, p, size)[0] for p in ("lru", "lfu", "reuse")}
        assert rates["reuse"] > rates["lfu"] + 0.2, (size, rates)
        assert rates["reuse"] > rates["lru"] - 0.02, (size, rates)
    assert simulate(steps, "reuse", 12)[0] > simulate(steps, "lru", 12)[0] + 0.3


def test_every_policy_takes_the_incoming_key() -> None:
    for name in POLICIES:
        stats = RoutingStats()
        policy = make_policy(name, stats)
        a, b = ExpertKey("m", 0, 0), ExpertKey("m", 1, 1)
        policy.on_insert(a)
        policy.observe(stats.observe("m", 0, {0: 1}))
        assert policy.evict({a}, b) == a, name


def test_one_store_of_routing_statistics_on_one_clock() -> None:
    """A layer's features, its token load and the transitions to the next layer come from the
    same visits: shares are decayed means (a young layer's are not biased low), the load is
    decayed tokens, a transition is counted only between consecutive MoE layers."""
    stats = RoutingStats()
    stats.declare("m", [3, 7], 4)
    assert stats.load("m") is None
    stats.observe("m", 3, {1: 5, 2: 0})
    stats.observe("m", 7, {0: 2})
    stats.observe("m", 3, {1: 1, 3: 1})
    layer = stats.model("m").layers[3]
    assert layer.visits == 2 and layer.features.shape == (4, FEATURES)
    assert list(layer.features[:, LAST]) == [0, 1, 0, 1]
    assert layer.features[1, SHARE[1.0]] == 1.0  # selected at every visit: share 1 at any horizon
    assert layer.features[1, SHARE[float("inf")]] == 1.0
    assert layer.features[3, SHARE[float("inf")]] == 0.5
    load = stats.load("m")
    assert load is not None and load.shape == (2, 4)
    assert load[0, 1] > 5.0 and load[0, 2] == 0.0 and load[1, 0] == 2.0
    onward = stats.model("m").layers[3].onward
    assert onward[1, 0] > 0 and onward.sum() == onward[1, 0]  # 3 -> 7 once
    back = stats.model("m").layers[7].onward  # 7 -> 3: decode wraps round
    assert back[0, 1] > 0 and back[0, 3] == back[0, 1] and back.sum() == 2 * back[0, 1]
    assert stats.model("m").next_layer(7) == 3


def test_the_next_layer_predictor_learns_a_transition_and_falls_back_to_history() -> None:
    """Layer 0's expert e is always followed by layer 1's expert (e + 3) % 8: after a few
    tokens the prediction is that expert; a layer with no transitions yet is predicted from
    its own last selection."""
    stats = RoutingStats()
    stats.declare("m", range(3), 8)
    predictor = NextLayerPredictor(stats)
    rng = random.Random(1)
    for _ in range(40):
        e = rng.randrange(8)
        stats.observe("m", 0, {e: 1})
        stats.observe("m", 1, {(e + 3) % 8: 1})
        stats.observe("m", 2, {rng.randrange(8): 1})
    stats.observe("m", 0, {5: 1})
    assert predictor.predict("m", 1) == (1, [0])
    fresh = RoutingStats()
    fresh.declare("m", range(3), 8)
    assert NextLayerPredictor(fresh).predict("m", 2) == (-1, [])
    fresh.observe("m", 1, {4: 1, 6: 2})
    fresh.observe("m", 0, {2: 1})
    assert NextLayerPredictor(fresh).predict("m", 2) == (1, [4, 6])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 12), st.integers(0, 41),
       st.floats(0.0, 2.0), st.integers(0, 2**32 - 1))
def test_the_compiled_prediction_is_the_formula(experts: int, before: int, chosen: int,
                                                k: int, weight: float, seed: int) -> None:
    """The predictor's compiled scores and top-k equal the formula written out in NumPy (the
    next layer's history weighted, plus each chosen expert's normalised transition row, a
    row narrower or wider than the next layer included) and a stable sort of the scores,
    ties (rounded scores make many) to the lower index, only positive scores."""
    rng = np.random.default_rng(seed)
    features = np.round(rng.random((experts, FEATURES)), 1)
    onward = np.round(rng.random((before, experts + int(rng.integers(-experts + 1, 4)))), 1)
    picked = rng.choice(before, min(chosen, before), replace=False).astype(np.int64)
    want = weight * (0.5 * features[:, LAST] + 0.5 * features[:, SHARE[HISTORY_HORIZON]])
    rows = onward[picked]
    votes = (rows / np.maximum(rows.sum(axis=1, keepdims=True), 1e-9)).sum(axis=0)
    width = min(votes.size, want.size)
    want[:width] += votes[:width]
    got = scores(features, onward, picked, weight)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    order = [int(e) for e in np.argsort(-got, kind="stable")[:k] if got[e] > 0]
    assert top(got, k).tolist() == order


def test_prefetch_makes_more_experts_ready_than_demand_alone() -> None:
    """The replay of bench/cache_policies.py: a layer-to-layer dependence that demand caching
    cannot use and the predictor can."""
    rng = random.Random(2)
    steps = []
    for _ in range(300):
        e = rng.randrange(8)
        for layer in range(6):
            steps.append(RoutingStep(layer, ((e + layer) % 8, rng.randrange(8))))
    demand = simulate(steps, "reuse", 12)[0]
    ahead = replay(steps, "reuse", 12, prefetch=2)
    assert ahead["ready"] > demand + 0.1, (demand, ahead)
    assert 0.0 <= ahead["wasted"] < 1.0


def test_the_agent_prefetches_what_a_recorded_trace_taught_it(qwen_ckpt: Path,
                                                               tmp_path: Path) -> None:
    """``prefetch.traces_dir`` holds ``<model>.jsonl``: at LoadModel the agent's predictor
    learns that layer 0's expert e is followed by layer 1's (e + 3) % 6, and a ReportRouting
    of layer 0 choosing 2 with ``prefetch_top_k=1`` delivers layer 1's expert 5 ahead of use.
    A malformed trace is skipped: the model loads all the same."""
    model = "qpred"
    lines = []
    for t in range(60):
        e = t % 6
        lines += [json.dumps({"layer": 0, "experts": [e]}),
                  json.dumps({"layer": 1, "experts": [(e + 3) % 6]}),
                  json.dumps({"layer": 2, "experts": [t % 5]})]
    (tmp_path / f"{model}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "broken.jsonl").write_text('{"layer": "x"}\n')
    with AgentProcess(f'[arena]\nbytes = "64MiB"\n[prefetch]\ntraces_dir = "{tmp_path}"\n'
                      ) as agent, AgentClient(agent.address) as client:
        info = client.load_model(str(qwen_ckpt), model)
        assert client.load_model(str(qwen_ckpt), "broken").model == "broken"
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(info.expert_bytes, 4)])
        l0, l1 = info.moe_layers[0], info.moe_layers[1]
        client.report_routing(model, [(l0, {2: 1})], prefetch_to=dev, prefetch_top_k=1)
        assert_prefetched(client, dev, ExpertKey(model, l1, 5), ExpertKey(model, l1, 0))


@pytest.mark.parametrize("layers", [1, 2, 8])
def test_the_fit_looks_ahead_the_visits_of_its_horizon(layers: int) -> None:
    """The reuse fit after a trace equals the ridge least-squares solution over every visit
    whose horizon is complete, each visit's features against the discounted share of the next
    ``round(HORIZON_STEPS / layers)`` visits of its layer that selected each expert (at least
    one: many layers look at the next visit alone), summed with the policy's forgetting."""
    steps = list(generate_trace(layers, 16, 3, 120, seed=layers))
    stats = RoutingStats()
    policy = LearnedReusePolicy(stats)
    for layer in range(layers):  # every layer and expert known before the first visit
        stats.layer("m", layer, 16)
        policy.on_insert(ExpertKey("m", layer, 15))
    ahead = max(1, round(HORIZON_STEPS / layers))
    weights = HORIZON_DISCOUNT ** np.arange(ahead)
    weights /= weights.sum()
    history: dict[int, list[np.ndarray]] = {layer: [] for layer in range(layers)}
    k = FEATURES
    acc = np.zeros((k + 1, k + 1))
    for step in steps:
        visit = stats.observe("m", step.layer, {e: 1 for e in step.experts})
        policy.observe(visit)
        seen = history[step.layer]
        seen.append(visit.before.copy())
        if len(seen) >= ahead:
            x = seen[-ahead].copy()
            x[:, k] = weights @ np.stack([v[:, k] for v in seen[-ahead:]])
            acc = policy._forget * acc + x.T @ x
    expected = np.linalg.solve(acc[:k, :k] + policy._ridge * np.eye(k), acc[:k, k])
    np.testing.assert_allclose(policy._models["m"].weights, expected, rtol=1e-6, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.floats(0.5, 1.0), st.floats(1e-4, 1.0), st.integers(0, 2**32 - 1))
def test_the_compiled_fit_is_the_ridge_least_squares_solution(
        experts: int, forget: float, ridge: float, seed: int) -> None:
    """One visit's update of the reuse fit (compiled) equals the ridge least-squares solution
    NumPy computes from the same forgetting sums."""
    rng = np.random.default_rng(seed)
    k = FEATURES
    old = rng.random((k + 1, 3 * (k + 1)))
    acc = old @ old.T
    x = (rng.random((experts, k + 1)) < 0.5).astype(np.float64)
    x[:, 0] = 1.0
    expected_acc = forget * acc + x.T @ x
    expected = np.linalg.solve(expected_acc[:k, :k] + ridge * np.eye(k), expected_acc[:k, k])
    weights = np.zeros(k)
    learn(acc, x, forget, ridge, weights)
    np.testing.assert_allclose(acc, expected_acc, rtol=1e-12)
    np.testing.assert_allclose(weights, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("visits", [0, 1, 7, 4095, 4096, 10_000])
def test_a_visit_folds_in_as_the_features_are_defined(visits: int) -> None:
    """A visit after ``visits`` others: every share column becomes the decayed mean of the
    selections, computed here from its definition (``V_t`` the decayed visit count), the
    last-visit column marks exactly the chosen experts, the load decays and gains the tokens."""
    layer = LayerStats()
    layer.grow(6)
    rng = np.random.default_rng(visits)
    before = rng.random((6, FEATURES))
    before[:, 0] = 1.0
    layer.features[:] = before
    layer.load[:] = load = rng.random(6)
    layer.visits = visits
    chosen = np.array([4, 1], np.intp)
    returned, table = layer.visit(chosen, np.array([3.0, 2.0]))
    selected = np.zeros(6)
    selected[chosen] = 1.0
    np.testing.assert_array_equal(returned[:, FEATURES], selected)
    np.testing.assert_array_equal(returned[:, :FEATURES], before)
    after = layer.features
    np.testing.assert_array_equal(table[:, :FEATURES], after)
    np.testing.assert_array_equal(after[:, 0], 1.0)
    np.testing.assert_array_equal(after[:, LAST], selected)
    for h in HALF_LIVES:
        d = 0.5 ** (1.0 / h)
        count = [float(t) if d == 1.0 else (1 - d ** t) / (1 - d) for t in (visits, visits + 1)]
        want = (d * count[0] * before[:, SHARE[h]] + selected) / count[1]
        # Past the table a finite horizon keeps its converged update (off by < 1e-6).
        np.testing.assert_allclose(after[:, SHARE[h]], want,
                                   rtol=1e-9 if visits < 4096 else 1e-6, err_msg=f"h={h}")
    np.testing.assert_allclose(layer.load, load * 0.5 ** (1 / LOAD_HALF_LIFE)
                               + np.array([0, 2.0, 0, 0, 3.0, 0]), rtol=1e-12)
    assert layer.visits == visits + 1


def test_the_compiled_fold_refuses_an_index_outside_the_layer() -> None:
    """The fold's compiled loops check indices: an expert beyond the layer's arrays raises
    IndexError and changes nothing (the public path grows the layer first)."""
    layer = LayerStats()
    layer.grow(4)
    layer.visit(np.array([1], np.intp), np.array([3.0]))
    features, load = layer.features.copy(), layer.load.copy()
    for bad in (7, -1):
        with pytest.raises(IndexError, match="outside the layer"):
            layer.visit(np.array([2, bad], np.intp), np.array([1.0, 1.0]))
    np.testing.assert_array_equal(layer.features, features)
    np.testing.assert_array_equal(layer.load, load)
    assert layer.visits == 1
    stats = RoutingStats()
    stats.observe("m", 0, {7: 2})  # grows to 8 experts, then folds
    assert stats.layer("m", 0).experts == 8


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_the_harness_replays_what_a_real_agents_arena_does(tmp_path: Path, policy: str) -> None:
    """bench/cache_policies.py's hit rates stand for the agent's: a generated decode through a
    real agent whose slot pool holds one step (so every acquire reaches the arena), each
    visit reported, hits the arena as often as the harness's replay at the same size, within
    0.02 (the arena unpins an expert as its copy completes, so the order of a step's releases,
    and with it a few victims, may differ: 0.003-0.007 seen), where the harness's policies
    differ by 0.07 or more (LRU 0.51, LFU 0.61, learned reuse 0.63, or 0.56 without the
    visits)."""
    steps = list(generate_trace(4, 16, 4, 150, seed=11))
    root = make_checkpoint(tmp_path / "m", CheckpointSpec("qwen3-moe", layers=4, experts=16,
                                                          hidden=128, intermediate=128))
    blob = next(iter(build_catalog(root).experts.values())).blob_bytes
    size = 24
    settings = (f'[arena]\nbytes = {size * align_up(blob, ARENA_ALIGN)}\n'
                f'[cache]\npolicy = "{policy}"\n')
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(root), "m")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)])
        replay_decode(client, dev, model, steps)
        st = client.status()
    agent_rate = st.cache_hits / (st.cache_hits + st.cache_misses)
    harness_rate = simulate(steps, policy, size)[0]
    assert 0.2 < harness_rate < 0.9  # the size makes the policy choose
    assert abs(agent_rate - harness_rate) <= 0.02, (agent_rate, harness_rate)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
       st.lists(st.integers(0, 7), max_size=8, unique=True), st.integers(0, 2**32 - 1))
def test_the_one_layer_hint_names_the_victim_the_full_search_names(
        candidates: list[int], others: list[int], seed: int) -> None:
    """``evict(..., one_layer=...)`` (every candidate of one layer: a slot pool's home) takes
    the layer's least likely expert straight from its row when that one is a candidate, and
    the least likely of the candidates otherwise: the victim the search without the hint
    names, and the same state left behind (the next eviction agrees too)."""
    def made() -> LearnedReusePolicy:
        policy = _reuse_after(_sticky_trace(3, 8, 40, stay=0.6, seed=seed % 1000))
        for e in range(8):
            policy.on_insert(ExpertKey("m", 1, e))
        for e in others:
            policy.on_insert(ExpertKey("m", 0, e))
        return policy

    keys = {ExpertKey("m", 1, e) for e in candidates}
    hinted, plain = made(), made()
    incoming = ExpertKey("m", 1, 99)
    assert hinted.evict(keys, incoming, ("m", 1)) == plain.evict(keys, incoming)
    assert np.array_equal(hinted._models["m"].grid, plain._models["m"].grid)
    assert np.array_equal(hinted._models["m"].low, plain._models["m"].low)
    rest = {ExpertKey("m", 1, e) for e in range(8)} - keys
    assert hinted.evict(rest, incoming, ("m", 1)) == plain.evict(rest, incoming)
