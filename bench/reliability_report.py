"""Regenerate docs/RELIABILITY.md: run the fault tests now, and read the latest fuzz logs (`make
fuzz` on the CPU targets, `make gpu-check`'s fuzz stage on the CUDA kernels) and load results
(`bench/load.py`) from bench/results/.

Usage: python bench/reliability_report.py
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ROOT, machine, source_hash

FAULTS = [
    ("agent SIGKILLed during transfers",
     "tests/test_faults.py::test_agent_sigkill_client_notices_fails_and_recovers"),
    ("agent restarted gracefully (SIGTERM, as systemctl restart)",
     "tests/test_faults.py::test_graceful_restart_is_survived_like_a_kill"),
    ("agent restarted under load with a changed config",
     "tests/test_faults.py::test_restart_under_load_with_a_changed_config"),
    ("host process killed (transfer in flight)",
     "tests/test_faults.py::test_killed_host_process_is_reclaimed"),
    ("corrupted bytes in the arena (device pull)", "tests/test_faults.py::"
     "test_corrupted_arena_is_caught_refetched_and_counted[pull-cpu]"),
    ("corrupted bytes in the arena (DMA engine, checked by the client's device)",
     "tests/test_faults.py::test_corrupted_arena_is_caught_refetched_and_counted[engine-cpu]"),
    ("a shard shortened or rewritten after LoadModel", "tests/test_faults.py::"
     "test_shards_changed_under_the_agent_degrade_the_model_not_the_agent"),
    ("bytes rewritten in place, size and modification time put back", "tests/test_faults.py::"
     "test_bytes_changed_in_place_are_caught_by_the_ingest_manifest"),
    ("garbage written into a client's slot-state table", "tests/test_engine.py::"
     "test_scribbled_slot_states_mislead_only_their_own_client"),
    ("DMA-engine process killed with a transfer in hand",
     "tests/test_engine.py::test_engine_death_fails_in_flight_and_is_restarted"),
    ("DMA-engine process hung (SIGSTOP) with a transfer in hand", "tests/test_engine.py::"
     "test_a_hung_engine_is_killed_and_its_transfers_fail"),
    ("DMA-engine process stopped while a device's attach waits on it",
     "tests/test_engine_control.py::test_a_slow_engine_command_does_not_stall_other_devices"),
    ("session closed while its device's attach waits on a stopped DMA engine",
     "tests/test_engine_control.py::"
     "test_a_session_closed_while_its_device_attaches_leaves_nothing_attached"),
    ("DMA-engine process killed after a slot pool was deregistered",
     "tests/test_engine_control.py::test_a_deregistered_pool_is_closed_in_the_engine"),
    ("hostile request-ring entries", "tests/test_engine.py::"
     "test_hostile_requests_are_refused_and_change_nothing"),
    ("request-ring header overwritten by its client", "tests/test_engine.py::"
     "test_overwritten_channel_header_stops_service_with_an_error"),
    ("corrupted activation packets", "tests/test_activation_faults.py::"
     "test_corrupted_packets_are_caught_delivered_again_and_counted"),
    ("activation packet emptied on the wire (length 0, checksum 0: valid, short)",
     "tests/test_activation_faults.py::test_a_part_delivered_short_is_delivered_again"),
    ("caller's deadline passes during an arena fill",
     "tests/test_faults.py::test_caller_gone_during_a_fill_leaves_no_reference"),
    ("consumer stops reading", "tests/test_faults.py::"
     "test_stalled_consumer_holds_producers_back_and_loses_nothing"),
    ("device consumer gone (stuck ring)",
     "tests/test_end_to_end.py::test_stuck_consumer_is_an_error_not_a_hang"),
    ("lease expiry, twice", "tests/test_end_to_end.py::test_expired_lease_reclaims_session"),
    ("SIGKILL at random points of state writes",
     "tests/test_state.py::test_sigkill_during_writes_leaves_old_or_new_state"),
    ("SIGTERM with transfers in flight",
     "tests/test_systemd.py::test_sigterm_drains_then_cancels_and_exits_zero"),
    ("activation worker vanishes mid-request (its rings fall silent)",
     "tests/test_activation_faults.py::"
     "test_worker_vanishing_mid_request_fails_within_bound"),
    ("NIC stand-in process SIGKILLed", "tests/test_activation_faults.py::"
     "test_a_killed_nic_is_restarted_on_its_port_with_its_workers"),
    ("experts migrated under activation traffic",
     "tests/test_activations.py::test_migration_under_traffic_loses_nothing"),
    ("network link to a sender cut (veth into a network namespace)",
     "tests/test_netns.py::test_a_cut_sender_times_out_and_the_nic_serves_on"),
    ("hostile activation frames against the NIC stand-in (hypothesis)",
     "tests/fuzz/test_fuzz_frames.py::test_fuzz_frames_against_the_nic"),
    ("cluster agent SIGKILLed", "tests/test_cluster.py::"
     "test_three_agents_reconcile_fetch_from_peers_forward_and_survive_a_kill"),
    ("etcd unreachable at agent start",
     "tests/test_cluster.py::test_unreachable_etcd_retries_then_fails_clearly"),
    ("peer agent serves corrupted expert bytes",
     "tests/test_cluster.py::test_peer_fetch_verifies_chunks_and_falls_back"),
    ("fuzzed descriptors, guard bytes (CPU twin)",
     "tests/test_kernels.py::test_fuzzed_descriptors_status_and_guards[cpu]"),
    ("undecodable request bodies on every RPC", "tests/test_hostile_rpc.py::"
     "test_undecodable_bodies_are_invalid_argument_on_every_method"),
    ("a client opening sessions and devices without end, and hammering every RPC",
     "tests/test_hostile_rpc.py::"
     "test_a_hostile_client_is_bounded_in_sessions_devices_and_memory"),
    ("a handler raises what it should have turned into a status", "tests/test_hostile_rpc.py::"
     "test_an_exception_that_escapes_a_handler_is_internal_with_a_request_id"),
    ("a second session registers the first one's rings (names read in /dev/shm)",
     "tests/test_security.py::test_another_sessions_rings_cannot_be_registered"),
    ("a second session registers a segment before its creator does",
     "tests/test_security.py::"
     "test_a_segment_is_registered_only_by_the_session_it_was_named_for"),
    ("a client never reads its event stream while 20,480 events are emitted for it",
     "tests/test_hostile_rpc.py::test_an_unread_event_stream_is_bounded_and_counted"),
    ("a client of another Unix user, with and without a group shared with the agent",
     "tests/test_shm_group.py::"
     "test_an_agent_serves_a_client_of_another_user_through_their_group[cpu]"),
]
OUTCOME = {
    "a client never reads its event stream while 20,480 events are emitted for it":
    "the agent keeps at most 4,096 (the oldest dropped, counted in "
    "dpu_agent_session_events_dropped_total: read by the client's own reader + kept + dropped "
    "= emitted; one count for every session, so a close races nothing; events after the "
    "session's end, or left on a replaced stream, are counted too); the session's end "
    "still reaches the stream",
    "a client of another Unix user, with and without a group shared with the agent":
    "without `[sessions] shm_group` the client is refused at the agent's first segment, "
    "naming the setting; with it (both users members) the expert it acquires lands the "
    "checkpoint's bytes (two uids, CPU reference device; skipped where not root)",
    "a second session registers the first one's rings (names read in /dev/shm)":
    "PERMISSION_DENIED naming the segment for each of the work, completion, rx and tx rings; "
    "nothing registered; the owner's acquires still land the checkpoint's bytes",
    "a second session registers a segment before its creator does": "PERMISSION_DENIED: a "
    "segment's name carries an HMAC of it keyed by the creating session's token, so only that "
    "session can register it (a made-up name too is refused); the creator then registers it",
    "agent SIGKILLed during transfers": "in-flight acquires fail with UNAVAILABLE in < 1 s; "
    "the client reconnects, reloads models, re-registers devices; every slot verified after",
    "agent restarted gracefully (SIGTERM, as systemctl restart)": "the clean end of the event "
    "stream is taken as the agent going away: the client idles (its threads < 5 % of a core) "
    "while it is down, then reconnects and serves verified bytes as after SIGKILL",
    "agent restarted under load with a changed config": "four threads acquiring and releasing "
    "through a SIGTERM restart onto another chunk size and arena: only typed errors while the "
    "agent is away (acquires posted then fail at once instead of waiting out their timeout on "
    "the dead channel), no thread hangs, each gets the checkpoint's bytes from the new agent",
    "host process killed (transfer in flight)": "session reclaimed within the 1 s lease; "
    "transfers in flight and arena pins back to 0",
    "corrupted bytes in the arena (device pull)": "the device's consumer catches the checksum "
    "mismatch before READY; refetched from the checkpoint, dpu_agent_checksum_failures_total "
    "counts it, slot bytes correct",
    "corrupted bytes in the arena (DMA engine, checked by the client's device)": "the engine "
    "copies only; the check of the LANDED slot in the client (the NumPy twin of "
    "dpu_verify_landed) publishes FAILED, the agent counts it and drops the arena copy, the "
    "wait acquires again and gets the checkpoint's bytes",
    "a shard shortened or rewritten after LoadModel": "no SIGBUS (fills use pread): its experts "
    "fail FAILED_PRECONDITION naming the file, the model shows degraded in status and metrics, "
    "other models carry on; restored and loaded again, it serves the files' bytes",
    "bytes rewritten in place, size and modification time put back": "with an ingest "
    "manifest beside the checkpoint, the fill's checksums differ from it: FAILED_PRECONDITION, "
    "model degraded; a manifest of another checkpoint is refused at LoadModel",
    "garbage written into a client's slot-state table": "no verdict for the slot's "
    "generation: no mismatch counted, another session served, the client's next delivery "
    "publishes over it",
    "DMA-engine process killed with a transfer in hand": "noticed within a sweep (< 1.5 s), the "
    "waiter gets TransferFailed(CANCELLED), fresh rings, a new engine serves the same expert "
    "byte for byte",
    "DMA-engine process hung (SIGSTOP) with a transfer in hand": "past "
    "transfer.timeout_seconds the agent kills it rather than cancel under it (no late copy or "
    "SIGNAL into a slot given to another delivery): the waiter gets CANCELLED, a new engine "
    "serves the same expert byte for byte",
    "DMA-engine process stopped while a device's attach waits on it": "another device of the "
    "session gets its expert byte for byte in under a second and status answers (the data-plane "
    "loop and the gRPC loop do not wait behind the engine; the session's 3 s lease is kept); "
    "the attach completes once the engine resumes",
    "session closed while its device's attach waits on a stopped DMA engine": "other "
    "sessions' calls are answered meanwhile; once the engine answers, the attach ends "
    "NOT_FOUND naming the close and the engine holds no ring of the closed session's devices",
    "DMA-engine process killed after a slot pool was deregistered": "the deregistered pool's "
    "mapping leaves the engine; the restarted engine reopens only the pools still registered "
    "and serves the other pool's expert byte for byte",
    "a client opening sessions and devices without end, and hammering every RPC": "past "
    "sessions.max_sessions and sessions.max_devices RESOURCE_EXHAUSTED naming the key, a closed "
    "session frees its place; 30 rounds of undecodable bodies on every method grow the "
    "agent's RSS by less than 16 MiB",
    "hostile request-ring entries": "unknown op, model, layer, expert, a release not held, a "
    "reused id: each answered with its status and a message; held slot's bytes and state word "
    "unchanged; the agent keeps serving",
    "request-ring header overwritten by its client": "the agent stops serving that channel "
    "(BAD_RING in its fault word), the client's wait raises UNAVAILABLE; other sessions carry "
    "on",
    "corrupted activation packets": "refused by the receive twin before the rows are used, the "
    "part refused and the message written again by the NIC, dpu_worker_packets_refused_total "
    "and dpu_agent_activation_retransmits_total count it, the combined output matches the "
    "dense reference; corrupted on every try: WORKER_FAILED, credit back",
    "activation packet emptied on the wire (length 0, checksum 0: valid, short)": "no packet "
    "is refused, but the part leaves a hole: written again by the NIC, output equals the dense "
    "reference",
    "caller's deadline passes during an arena fill": "DEADLINE_EXCEEDED to the caller; the "
    "fills finish and the agent gives back every reference the lost response carried",
    "consumer stops reading": "ring never overwritten (<= capacity outstanding), producer "
    "backlog held, every expert lands byte-exact when it resumes",
    "device consumer gone (stuck ring)": "transfer cancelled after transfer.timeout_seconds, "
    "slot freed, client gets CANCELLED, no hang",
    "lease expiry, twice": "both sessions reclaimed; the reaper survives",
    "undecodable request bodies on every RPC": "25 bodies per method: INVALID_ARGUMENT naming "
    "the message, never UNKNOWN or INTERNAL; the agent stays SERVING",
    "a handler raises what it should have turned into a status": "INTERNAL naming a request "
    "id, and the agent's log line carries the same id (unary and streaming)",
    "SIGKILL at random points of state writes": "restart finds the old or the new state",
    "SIGTERM with transfers in flight": "waits out the grace, cancels the rest, exit 0",
    "activation worker vanishes mid-request (its rings fall silent)": "the sender gets "
    "WORKER_FAILED within the 1 s bound, its credit back, and the dead worker stops being a route",
    "NIC stand-in process SIGKILLed": "a new one within the 0.5 s sweep on the same port, "
    "every worker's rings attached again; the next dispatch is served by the same worker",
    "experts migrated under activation traffic": "three moves while dispatching: sent = "
    "received, no error, traffic follows the moves",
    "network link to a sender cut (veth into a network namespace)": "the sender's wait ends "
    "with its own 2 s timeout (+1.5 s), the NIC takes its four credits back as the worker "
    "answers into the dead link, and serves the next sender at once",
    "hostile activation frames against the NIC stand-in (hypothesis)": "every frame answered "
    "once (output only for a valid request, else ERROR with a status and a reason), placed "
    "slots unchanged, the NIC and agent up, a valid request served after every example",
    "cluster agent SIGKILLed": "its membership expires within the 2 s lease; the planner "
    "re-places its experts on the survivors, every expert held again within 15 s",
    "etcd unreachable at agent start": "retries with backoff for the join timeout, then exits "
    "non-zero naming the endpoint; never READY",
    "peer agent serves corrupted expert bytes": "the chunk fails its checksum, the next peer "
    "serves it; with no good peer the fill falls back to the checkpoint files",
    "fuzzed descriptors, guard bytes (CPU twin)": "statuses match an independent oracle, "
    "guard bytes intact",
}


def run_faults() -> dict[str, tuple[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "faults.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}",
                        *[t for _, t in FAULTS]], cwd=ROOT)
        out = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("name", "")
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            out[name] = ("FAILED" if failed else "skipped" if skipped else "passed",
                         float(case.get("time", 0)))
    return out


def outcome(results: dict[str, tuple[str, float]], name: str) -> tuple[str, float]:
    """The result of the fault test ``name`` (a test function's name, with its parameter where
    one case is meant): a test named bare stands for all its parametrized cases together, FAILED
    if any failed, skipped only if all were, their seconds summed; "not run" if none ran."""
    cases = [r for case, r in results.items()
             if case == name or ("[" not in name and case.startswith(name + "["))]
    if not cases:
        return "not run", 0.0
    statuses = {status for status, _ in cases}
    status = "FAILED" if "FAILED" in statuses else "passed" if "passed" in statuses else "skipped"
    return status, sum(seconds for _, seconds in cases)


FUZZ_LOGS = (("CPU", RESULTS / "fuzz.log", "make fuzz"),
             ("GPU", RESULTS / "gpu-logs" / "fuzz-gpu.log", "make gpu-check, fuzz stage"))
"""Where each device's fuzz run leaves its hypothesis statistics, and what writes it."""


def fuzz_counts(log: Path) -> tuple[dict[str, int], str]:
    """Examples per target (``passing``; failures as their own `` (FAILING)`` row) from a
    ``--hypothesis-show-statistics`` log, and where and when it ran: the log's ``# fuzz-gpu``
    first line where the GPU check wrote one, else the file's date."""
    counts: dict[str, int] = {}
    current = None
    text = log.read_text().splitlines()
    for line in text:
        m = re.match(r"tests/fuzz/\w+\.py::(\w+):", line)
        if m:
            current = m[1]
        m = re.search(r"(\d+) passing, (\d+) failing", line)
        if m and current:
            counts[current] = counts.get(current, 0) + int(m[1])
            if int(m[2]):
                counts[current + " (FAILING)"] = int(m[2])
    where = str(log.relative_to(ROOT))
    if text and text[0].startswith("# fuzz-gpu "):
        return counts, f"{where}: {text[0][len('# fuzz-gpu '):]}"
    stamp = dt.datetime.fromtimestamp(log.stat().st_mtime, dt.timezone.utc).date()
    return counts, f"{where}, {stamp}"


def main() -> int:
    faults = run_faults()
    load_path = RESULTS / "load.json"
    load = json.loads(load_path.read_text()) if load_path.exists() else None
    m = machine()
    lines = ["# Reliability", "",
             f"Generated by `bench/reliability_report.py` on "
             f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, source "
             f"{source_hash()}, {m.get('cpu', m['arch'])}, {m['cpus']} cores. Do not edit: run "
             "`make reliability` (after `make fuzz` and `python bench/load.py`).", "",
             "## Faults injected (real processes)", "",
             "| fault | result | what the test checks | seconds |", "|---|---|---|---|"]
    for fault, test in FAULTS:
        status, secs = outcome(faults, test.split("::")[1])
        lines.append(f"| {fault} | {status} | {OUTCOME[fault]} | {secs:.1f} |")
    lines += ["", "## Bad inputs tried", ""]
    rows = []
    for device, log, how in FUZZ_LOGS:
        if not log.exists():
            lines.append(f"- {device}: no fuzz log yet ({how})")
            continue
        counts, src = fuzz_counts(log)
        lines.append(f"- {device}: {src}")
        rows += [f"| `{k}` | {device} | {v:,} |" for k, v in counts.items()]
    lines += ["", "| target | device | examples |", "|---|---|---|"]
    lines += rows or ["| (none) | | |"]
    lines += ["", "Invariants: no crash, only documented status codes, a refusal changes no "
              "state, no write outside a region.", "", "## Load held", ""]
    if load:
        r = load["results"]
        lines += [f"`{load['command']}` on {load['date'][:10]} (source {load['source_hash']}): "
                  f"{r['clients']} clients for {r['seconds']:.0f} s against a 16 MiB arena "
                  f"(constant eviction): {r['requests']:,} acquire/release cycles "
                  f"({r['requests_per_second']:.0f}/s), acquire-to-verified p50 "
                  f"{r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms; from "
                  f"{r.get('activation_senders', 0)} of the clients, "
                  f"{r.get('activation_dispatches', 0):,} MoE-layer activation dispatches "
                  f"through the router to a worker process (p50 "
                  f"{r.get('activation_p50_ms', float('nan')):.1f} ms, p99 "
                  f"{r.get('activation_p99_ms', float('nan')):.1f} ms); errors {r['errors']}, "
                  f"deadlocks {r['deadlocks']}, agent RSS growth (last quarter vs second) "
                  f"{r['rss_growth_late_vs_early']:+.1%}. All clients and the agent share 2 CPU "
                  "cores, so latency here measures contention, not the agent."]
    else:
        lines += ["No load results yet (python bench/load.py)."]
    lost = "0" if all(s == "passed" for s, _ in faults.values()) else "see FAILED rows"
    lines += ["", f"## Bytes lost or corrupted: {lost}", "",
              "Every fault test above compares delivered slot bytes with the checkpoint files "
              "(read by the safetensors library) or checks ring and guard invariants.", ""]
    (ROOT / "docs" / "RELIABILITY.md").write_text("\n".join(lines))
    print("wrote docs/RELIABILITY.md")
    return 0 if all(s == "passed" for s, _ in faults.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
