"""Placement invariants (property-based), refusals, and the CLI on a load file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.planning.placement import PlacementError, plan


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, list[int], int]:
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(1, 24))
    gpus = draw(st.integers(1, 6))
    replicas = draw(st.integers(0, min(gpus, experts * (gpus - 1))))
    base = -(-(experts + replicas) // gpus)
    slots = [base + draw(st.integers(0, 2)) for _ in range(gpus)]
    load = draw(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=layers * experts,
                         max_size=layers * experts))
    return np.array(load).reshape(layers, experts), slots, replicas


def _check(p, load: np.ndarray, slots: list[int], replicas: int) -> None:
    layers, experts = load.shape
    for layer in range(layers):
        per_gpu = [0] * len(slots)
        copies = 0
        for e in range(experts):
            gpus = p.assignment[layer][e]
            assert gpus, f"expert {e} unplaced"
            assert len(set(gpus)) == len(gpus), "two copies on one GPU"
            copies += len(gpus)
            for g in gpus:
                per_gpu[g] += 1
        assert all(n <= cap for n, cap in zip(per_gpu, slots, strict=True)), "over capacity"
        assert copies == experts + replicas
        # Loads split evenly over copies add back up to the layer's load.
        assert p.gpu_load[layer].sum() == pytest.approx(load[layer].sum(), rel=1e-9, abs=1e-6)


@given(problems())
@settings(max_examples=80, deadline=None)
def test_invariants_fresh_and_rebalanced(problem) -> None:
    load, slots, replicas = problem
    first = plan(load, slots, replicas=replicas, expert_bytes=100)
    _check(first, load, slots, replicas)
    drifted = load[::-1].copy() if load.shape[0] > 1 else load * 0.5 + 1
    again = plan(drifted, slots, replicas=replicas, current=first.assignment, expert_bytes=100)
    _check(again, drifted, slots, replicas)
    lpt = plan(drifted, slots, replicas=replicas)
    assert again.max_load_ratio <= lpt.max_load_ratio * 1.02 + 1e-9
    assert again.bytes_moved == again.copies_moved * 100


def test_unchanged_load_moves_nothing() -> None:
    load = np.random.default_rng(1).integers(1, 100, (4, 32)).astype(float)
    p = plan(load, 4, replicas=2, expert_bytes=10)
    q = plan(load, 4, replicas=2, current=p.assignment, expert_bytes=10)
    assert q.bytes_moved == 0 and q.assignment == p.assignment


def test_replicas_go_to_hot_experts() -> None:
    load = np.array([[1000.0, 1, 1, 1, 1, 1, 1, 1]])
    p = plan(load, 4, replicas=3)
    assert len(p.assignment[0][0]) == 4
    assert p.max_load_ratio < 1.5


@pytest.mark.parametrize("kwargs,msg", [
    ({"load": np.ones(5), "gpus": 2}, "shape"),
    ({"load": np.full((2, 4), np.nan), "gpus": 2}, "NaN"),
    ({"load": -np.ones((2, 4)), "gpus": 2}, "negative"),
    ({"load": np.ones((2, 8)), "gpus": [3, 3]}, "cannot hold one copy"),
    ({"load": np.ones((2, 4)), "gpus": [3, 3], "replicas": 3}, "replica budget"),
    ({"load": np.ones((1, 4)), "gpus": [4, 4], "current": [[[0], [1], [7], [0]]]},
     "unknown GPU 7"),
    ({"load": np.ones((1, 4)), "gpus": [4, 4], "current": [[[0], [1]]]}, "not \\[1 layers"),
    ({"load": np.ones((1, 4)), "gpus": [4, 4], "current": [[[0], [1], [1.5], [0]]]},
     "unknown GPU 1.5 for layer 0 expert 2"),
    ({"load": np.ones((1, 4)), "gpus": [4, 4], "current": [[[0], [1], ["1"], [0]]]},
     "unknown GPU '1'"),
    ({"load": np.ones((1, 4)), "gpus": [4, 4], "current": [[[0], [1], 1, [0]]]},
     "not \\[1 layers\\]\\[4 experts\\] lists"),
    ({"load": np.ones((2, 4)), "gpus": [4, 4], "expert_bytes": [1, 2, 3]},
     "one per layer \\(2\\), got 3"),
])
def test_refusals_name_the_constraint(kwargs: dict, msg: str) -> None:
    with pytest.raises(PlacementError, match=msg):
        plan(**kwargs)


def test_cli_plan_on_a_load_file(tmp_path: Path) -> None:
    load = np.random.default_rng(2).integers(0, 1000, (3, 16)).astype(np.float64)
    np.save(tmp_path / "load.npy", load)
    cmd = [sys.executable, "-m", "dpu_agent.cli", "plan", "--load", str(tmp_path / "load.npy"),
           "--gpus", "4", "--replicas", "2", "--json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["max_load_ratio"] >= 1.0 and len(out["assignment"]) == 3
    (tmp_path / "current.json").write_text(json.dumps(out))
    again = json.loads(subprocess.run([*cmd, "--current", str(tmp_path / "current.json"),
                                       "--expert-bytes", "1000"], capture_output=True,
                                      text=True, check=True).stdout)
    assert again["bytes_moved"] == 0
    bad = subprocess.run([*cmd[:-5], "--gpus", "1", "--replicas", "5"], capture_output=True,
                         text=True)
    assert bad.returncode == 1 and "replica budget" in bad.stderr


def test_heterogeneous_byte_capacities() -> None:
    load = np.ones((2, 6))
    # GPU 0 holds 8 experts of 10 bytes over 2 layers (4 per layer), GPU 1 only 2 per layer.
    p = plan(load, [80, 40], expert_bytes=10, capacity="bytes")
    per_gpu = [sum(g == 0 for gs in p.assignment[0] for g in gs),
               sum(g == 1 for gs in p.assignment[0] for g in gs)]
    assert per_gpu[0] <= 4 and per_gpu[1] <= 2 and sum(per_gpu) == 6
    with pytest.raises(PlacementError, match="cannot hold one copy"):
        plan(load, [40, 40], expert_bytes=10, capacity="bytes")
