"""The load benchmark's short form: concurrent clients, constant eviction, no errors, no
deadlocks, bounded agent memory."""

from __future__ import annotations

from bench.load import run


def test_short_load_has_no_errors_or_deadlocks() -> None:
    r = run(clients=8, seconds=4, stall=10)
    assert r["errors"] == 0, r["error_samples"]
    assert r["deadlocks"] == 0 and r["agent_alive"]
    assert r["requests"] > 50
    assert r["activation_senders"] == 2 and r["activation_dispatches"] > 5
