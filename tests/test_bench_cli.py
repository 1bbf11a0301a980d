"""The benchmarks' command lines: each parses its arguments and imports what it needs on a
machine without a GPU, and the transformers benchmark runs end to end on the CPU reference
device at a reduced size (a routing trace replayed, the DMA engine filling the experts), its
offloaded outputs equal to the resident run's (it exits non-zero otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpu_agent.routing.traces import generate_trace, write_trace

ROOT = Path(__file__).resolve().parents[1]
CLIS = ["ab", "activations", "agent_requests", "arm64", "cache_policies", "cluster", "decode",
        "delivery", "grouped_mm", "launch_after_sleep", "layer_parts", "load", "moe_kernels",
        "multi_gpu", "placement", "rebalance", "slot_check", "slot_pool", "spy_report", "steering",
        "trace_report", "transformers_decode"]


@pytest.mark.parametrize("bench", CLIS)
def test_each_benchmark_parses_its_arguments(bench: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / f"{bench}.py"), "--help"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


@pytest.mark.parametrize("argv,named", [
    (["decode.py", "--tokens", "0"], "--tokens: must be positive, got 0"),
    (["decode.py", "--gpu-cache-fraction", "1.5"], "--gpu-cache-fraction: must be above 0"),
    (["delivery.py", "--experts", "1"], "--experts: at least 2"),
    (["load.py", "--seconds", "inf"], "--seconds: must be above 0"),
    (["layer_parts.py", "--cache", "1.5"], "--cache in (0, 1]"),
    (["cache_policies.py", "--trace", "no-such-trace.jsonl"], "No such file or directory"),
    (["cache_policies.py", "--trace", "README.md"], "README.md:1: not a trace step"),
])
def test_a_benchmark_refuses_a_bad_argument_before_it_starts(argv: list[str],
                                                             named: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / argv[0]), *argv[1:]],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr


def test_the_agent_request_benchmark_measures_the_agents_thread() -> None:
    """``bench/agent_requests.py`` on a small checkpoint: every ACQUIRE granted, and the
    agent's data-plane thread seen spending CPU on the misses (a run that read no thread would
    report 0)."""
    import json

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "agent_requests.py"),
                          "--experts", "64", "--rounds", "1", "--no-save"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["experts"] == 64 and r["delivery"] == "engine"
    assert r["miss_agent_us"] > 1.0 and r["miss_batch_ms"] > 0


def test_transformers_benchmark_replays_a_trace_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, list(generate_trace(1, 64, 8, 64)))
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transformers_decode.py"), "--device", "cpu",
         "--arch", "olmoe-1b-7b", "--shrink", "16", "--layers", "2", "--batch", "1",
         "--new-tokens", "2", "--gpu-cache-fraction", "0.5", "--trace", str(trace),
         "--no-save"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"outputs_equal"' in out.stderr


def test_a_traced_delivery_run_times_all_three_processes(tmp_path: Path) -> None:
    """``bench/delivery.py --trace``: the client, the agent and the DMA engine each write their
    calls of the data path, every traced name still exists, and the report prints them; the
    traced figures are not saved as results."""
    import json

    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "delivery.py"), "--device", "cpu", "--quick",
         "--mechanisms", "engine", "--experts", "4", "--repeats", "1", "--trace",
         str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wrote" not in out.stdout
    traces = {f.name.split("-")[1]: json.loads(f.read_text())
              for f in tmp_path.glob("trace-*.json")}
    assert set(traces) == {"delivery.py", "dpu_agent.cli", "dma_engine"}, list(traces)
    assert all(not t["missing"] for t in traces.values()), [t["missing"] for t in traces.values()]
    for process, name in (("delivery.py", "ClientChannel.post"),
                          ("dpu_agent.cli", "SlotGrants.acquire"),
                          ("dpu_agent.cli", "TransferPlan.descriptors"),
                          ("dma_engine", "Planner.plan")):
        calls = traces[process]["calls"][name]
        assert calls and all(wall > 0 and cpu >= 0 for _, wall, cpu in calls), (process, name)
    report = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_report.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0 and "Planner.plan" in report.stdout


def test_ab_runs_the_sides_in_turn_and_reports_each_metric(tmp_path: Path) -> None:
    """bench/ab.py on a stand-in benchmark whose result is the environment it ran in: each
    side's values, in order, and their medians; a side that fails stops the run, named."""
    bench = tmp_path / "bench"
    (bench / "results").mkdir(parents=True)
    (bench / "fake.py").write_text(
        "import json, os, sys\n"
        "if os.environ.get('FAIL'): sys.exit('broken')\n"
        "v = float(os.environ['V'])\n"
        "open('bench/results/fake.json', 'w').write(json.dumps("
        "{'source_hash': 'x', 'results': {'row': {'m': v, 'n': {'deep': 2 * v}, "
        "'runs': [{'t': 5 * v}]}, 'flat': 4 * v}}))\n")
    run = [sys.executable, str(ROOT / "bench" / "ab.py"), "run", "--a", str(tmp_path), "--b",
           str(tmp_path), "--env-a", "V=1", "--env-b", "V=3", "--rounds", "2",
           "--metric", "m", "--metric", "n.deep", "--metric", "flat", "--metric", "runs.0.t",
           "--metric", "runs.1.t", "--",
           "bench/fake.py"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {tuple(line.split()[:3]): line for line in out.stdout.splitlines()}
    assert rows["row", "m", "A:"].endswith("median    1.0000")
    assert rows["row", "m", "B:"].endswith("median    3.0000")
    assert rows["row", "n.deep", "B:"].split()[3:5] == ["6.0000", "6.0000"]
    assert rows["(results)", "flat", "A:"].endswith("median    4.0000")  # a flat record
    assert rows["row", "runs.0.t", "B:"].endswith("median   15.0000")  # a list's item
    assert ("row", "runs.1.t", "A:") not in rows  # no such item: no row
    # Each round's table is printed when the round ends: a run cut short keeps it.
    first = out.stdout.split("after round 2 of 2:")[0].splitlines()
    assert first[0] == "after round 1 of 2:"
    assert "row m B: 3.0000 median 3.0000" in {" ".join(line.split()) for line in first}
    failed = subprocess.run([*run[:9], "--env-b", "FAIL=1", *run[11:]], capture_output=True,
                            text=True, timeout=120)
    assert failed.returncode != 0 and "bench/fake.py" in failed.stderr and "broken" in \
        failed.stderr
    # One tree and environment, the sides apart by the benchmark's arguments (a flag's A/B).
    (bench / "flag.py").write_text(
        "import json, sys\n"
        "v = float(sys.argv[sys.argv.index('--v') + 1]) if '--v' in sys.argv else 0.0\n"
        "open('bench/results/flag.json', 'w').write(json.dumps("
        "{'source_hash': 'x', 'results': {'row': {'m': v}}}))\n")
    base = [sys.executable, str(ROOT / "bench" / "ab.py"), "run", "--a", str(tmp_path), "--b",
            str(tmp_path), "--rounds", "1", "--metric", "m"]
    flags = subprocess.run([*base, "--args-b=--v 7", "--", "bench/flag.py"],
                           capture_output=True, text=True, timeout=120)
    assert flags.returncode == 0, flags.stderr
    rows = {tuple(line.split()[:3]): line for line in flags.stdout.splitlines()}
    assert rows["row", "m", "A:"].endswith("median    0.0000")
    assert rows["row", "m", "B:"].endswith("median    7.0000")
    same = subprocess.run([*base, "--args-a", "--v 7", "--args-b", "--v  7", "--",
                           "bench/flag.py"], capture_output=True, text=True, timeout=120)
    assert same.returncode == 2 and "same tree with the same environment and arguments" in \
        same.stderr
    # A metric the results lack stops the run after its first side, naming their keys.
    lacking = subprocess.run([*base[:-1], "tokens_per_s", "--args-b=--v 7", "--",
                              "bench/flag.py"], capture_output=True, text=True, timeout=120)
    assert lacking.returncode == 2 and "no --metric (tokens_per_s)" in lacking.stderr \
        and "their keys: row" in lacking.stderr and "side B" not in lacking.stderr


def test_the_source_hash_covers_every_package() -> None:
    from bench.common import SOURCE_DIRS

    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(SOURCE_DIRS), sorted(packages - set(SOURCE_DIRS))


def test_every_fault_test_the_reliability_report_runs_is_collected() -> None:
    """Each test bench/reliability_report.py runs exists under the name it gives (a test renamed
    or parametrized since read "not run" in docs/RELIABILITY.md), and a bare name stands for
    all of a parametrized test's cases: FAILED if one failed, skipped only if all were."""
    from bench.reliability_report import FAULTS, outcome

    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", *[t for _, t in FAULTS]],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    collected = {line.split("::", 1)[1]: ("passed", 1.0) for line in listed.stdout.splitlines()
                 if "::" in line}
    for fault, test in FAULTS:
        assert outcome(collected, test.split("::")[1])[0] == "passed", fault
    cases = {"t[a]": ("passed", 1.0), "t[b]": ("FAILED", 2.0), "s[a]": ("skipped", 0.5),
             "u[cpu]": ("passed", 1.5), "u[cuda]": ("skipped", 0.0)}
    assert outcome(cases, "t") == ("FAILED", 3.0)
    assert outcome(cases, "s") == ("skipped", 0.5)
    assert outcome(cases, "u") == ("passed", 1.5)
    assert outcome(cases, "u[cpu]") == ("passed", 1.5)
    assert outcome(cases, "t[c]") == ("not run", 0.0)


def test_cpu_counted_between_snapshots_survives_a_thread_that_ends() -> None:
    """A thread that had used CPU before the first snapshot and ends before the second takes
    only itself out of the count: the process's CPU in between is what its other threads used
    (the main thread's spin here), never less than nothing."""
    import os
    import threading
    import time

    from bench.common import CpuSnapshot

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, go = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (spin(0.2), spun.set(), go.wait()),
                              name="short-lived")
    worker.start()
    assert spun.wait(30)
    before = CpuSnapshot.take(os.getpid())
    assert before.since(CpuSnapshot(os.getpid(), {}))["short-lived"] >= 0.15
    go.set()
    worker.join()
    spin(0.05)
    used = CpuSnapshot.take(os.getpid()).since(before)
    assert "short-lived" not in used
    assert 0.04 <= used["MainThread"] and CpuSnapshot.take(os.getpid()).total_since(before) >= 0.04


def test_a_snapshot_does_not_count_its_own_reading() -> None:
    """Reading a thread-rich process's /proc costs the reader CPU (a CUDA process has
    dozens of threads): between two snapshots with nothing done in between, the calling thread
    has used a small part of what one snapshot costs, not the reading of both."""
    import os
    import threading
    import time

    from bench.common import CpuSnapshot

    done = threading.Event()
    idle = [threading.Thread(target=done.wait) for _ in range(64)]
    for t in idle:
        t.start()
    try:
        t0 = time.thread_time()
        CpuSnapshot.take(os.getpid())
        cost = time.thread_time() - t0
        before = CpuSnapshot.take(os.getpid())
        after = CpuSnapshot.take(os.getpid())
        assert after.since(before)["MainThread"] < cost / 4, cost
    finally:
        done.set()
        for t in idle:
            t.join()


def test_spy_report_tables_a_recording(tmp_path: Path) -> None:
    """bench/spy_report.py on a recording in py-spy's raw form (gzip too): samples by thread,
    leaf frames of the chosen threads, the paths below a function named exactly (not a name
    that merely contains it); a file in another form is refused, named."""
    import gzip

    lines = ["thread (1): MainThread;main (bench/x.py:3);Client.acquire (host_client/c.py:9);"
             "post (host_client/r.py:5) 30",
             "thread (1): MainThread;main (bench/x.py:3);Client.acquire (host_client/c.py:9);"
             "launch (gpu_kernels/l.py:7) 10",
             "thread (1): MainThread;main (bench/x.py:4);reacquire (bench/x.py:8) 20",
             "thread (2): dataplane;run (dpu_agent/loop.py:1);wait (dpu_offload/futex.py:47) 40"]
    raw = tmp_path / "spy.txt.gz"
    with gzip.open(raw, "wt") as f:
        f.write("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "spy_report.py"), str(raw),
                          "--thread", "MainThread", "--under", "acquire"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [" ".join(line.split()) for line in out.stdout.splitlines()]
    assert "spy.txt.gz: 100 samples" in rows
    assert "60 60.0 % thread (1): MainThread" in rows and "40 40.0 % thread (2): dataplane" in rows
    assert "30 50.0 % thread (1): MainThread post (r.py:5)" in rows  # 30 of MainThread's 60
    assert "below 'acquire': 40 samples (66.7 % of those)" in rows
    assert "30 75.0 % Client.acquire (c.py:9) > post (r.py:5)" in rows
    assert not any("reacquire" in r and ">" in r for r in rows)
    bad = tmp_path / "bad.txt"
    bad.write_text("not a stack\n")
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "spy_report.py"), str(bad)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "bad.txt:1: not py-spy raw output" in refused.stderr
