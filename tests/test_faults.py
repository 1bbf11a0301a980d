"""Faults on purpose: corrupted arena bytes are caught and refetched, a consumer that stops
reading holds producers back without losing anything, a killed host process is reclaimed, a
caller that gives up during a fill leaves no reference behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpu_offload.keys import ExpertKey
from dpu_offload.shm import SharedBuffer
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes


def _metric(agent: AgentProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def _names(key: ExpertKey) -> dict[str, str]:
    base = f"model.layers.{key.layer}.mlp.experts.{key.expert}"
    return {r: f"{base}.{r}.weight" for r in ("gate_proj", "up_proj", "down_proj")}


def _device(kind: str, ordinal: int) -> Any:
    if kind == "cuda":
        from host_client.cuda_device import CudaDevice

        return CudaDevice(0)
    return CpuReferenceDevice(ordinal)


def _host(array: Any) -> bytes:
    return (array.get() if hasattr(array, "get") else array).tobytes()


@pytest.mark.parametrize("delivery,kind", [
    ("pull", "cpu"), ("engine", "cpu"), pytest.param("engine", "cuda", marks=pytest.mark.gpu)])
def test_corrupted_arena_is_caught_refetched_and_counted(qwen_ckpt: Path, delivery: str,
                                                         kind: str) -> None:
    """Checked where the bytes land: by the device's consumer as it copies each chunk (pull),
    or, where the DMA engine copied, by the check of the landed slot on the device (a kernel on
    a GPU, the NumPy twin on the CPU reference device), after which the wait acquires again
    and the agent refetches from the checkpoint."""
    truth = checkpoint_bytes(qwen_ckpt)
    settings = ('[arena]\nbytes = "64MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n'
                '[transfer]\nchunk_bytes = 65536\n')
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qc")
        a = client.register_device(CpuReferenceDevice(0), [SlotPoolSpec(model.expert_bytes, 4)])
        key = ExpertKey("qc", 1, 2)
        client.acquire(a, key).wait(10)  # now resident in the arena
        arena = SharedBuffer(client.arena.shm_name, client.arena.size_bytes)
        before = _metric(agent, "dpu_agent_checksum_failures_total")
        # Flip bits in every used 64 KiB chunk of the arena (all resident experts).
        used = int(_metric(agent, "dpu_agent_arena_used_bytes"))
        arena.array[:used:65536] ^= 0x5A
        b = client.register_device(_device(kind, 1), [SlotPoolSpec(model.expert_bytes, 4)],
                                   delivery=delivery)
        slot = client.acquire(b, key).wait(20)
        for role, name in _names(key).items():
            assert _host(slot.raw(role)) == truth[name], role
        assert _metric(agent, "dpu_agent_checksum_failures_total") >= before + 1
        # The DMA engine's grants are held by the client's pins: the failed one's went with
        # it, the refetched one's stays until the release.
        pins = b.channel.view.pins["pins"]
        assert int(pins.sum()) == (1 if delivery == "engine" else 0)
        client.release(b, key)
        assert int(pins.sum()) == 0
        arena.close()


def test_stalled_consumer_holds_producers_back_and_loses_nothing(qwen_ckpt: Path) -> None:
    truth = checkpoint_bytes(qwen_ckpt)
    with AgentProcess('[transfer]\nchunk_bytes = 16384\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qs")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 18)],
                                     ring_capacity=8)
        dev.device.pause()
        keys = [ExpertKey("qs", layer, e) for layer in model.moe_layers for e in range(6)]
        handles = client.acquire_batch(dev, keys)  # far more chunks than 8 ring entries
        time.sleep(0.3)
        assert not any(h.done() for h in handles)
        assert dev.work.ring.produced - dev.work.ring.header["consumer"] <= 8, "overwrite"
        dev.device.resume()
        for h in handles:
            slot = h.wait(30)
            for role, name in _names(slot.key).items():
                assert slot.raw(role).tobytes() == truth[name]


def test_killed_host_process_is_reclaimed(qwen_ckpt: Path, tmp_path: Path) -> None:
    with AgentProcess('[sessions]\ndefault_lease_seconds = 1\n') as agent, \
            AgentClient(agent.address) as observer:
        host = textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
            from dpu_offload.keys import ExpertKey
            from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
            c = AgentClient({agent.address!r}, client_name="doomed")
            m = c.load_model({str(qwen_ckpt)!r}, "qk")
            d = c.register_device(CpuReferenceDevice(), [SlotPoolSpec(m.expert_bytes, 4)])
            for e in range(3):
                c.acquire(d, ExpertKey("qk", 0, e)).wait(10)
            d.device.pause()
            c.acquire_batch(d, [ExpertKey("qk", 0, 3)])  # granted, left in flight, blob pinned
            print("held", flush=True)
            time.sleep(60)
        """)
        proc = subprocess.Popen([sys.executable, "-c", host], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "held"
        st = observer.status()
        assert st.other_sessions == 1  # the doomed host's (status lists only our own)
        assert st.transfers_in_flight == 1 and st.arena_pins == 1
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while observer.status().other_sessions:
            assert time.monotonic() < deadline, "killed host's session not reclaimed"
            time.sleep(0.1)
        st = observer.status()
        assert st.transfers_in_flight == 0 and st.arena_pins == 0


class _Restartable:
    """An agent on a fixed port with a client that loaded ``qwen_ckpt`` as ``name`` and
    registered one CPU reference device; ``restart()`` starts a second agent on that port."""

    def __init__(self, qwen_ckpt: Path, name: str, slots: int) -> None:
        self.first = AgentProcess().start()
        self.second: AgentProcess | None = None
        self.client = AgentClient(self.first.address, rpc_timeout=10)
        self.model = self.client.load_model(str(qwen_ckpt), name)
        self.dev = self.client.register_device(CpuReferenceDevice(), [SlotPoolSpec(
            self.model.expert_bytes, slots)])

    def restart(self, settings: str = "") -> None:
        self.second = AgentProcess(settings, env={
            "DPU_AGENT_SERVER_LISTEN_ADDRESS": f"127.0.0.1:{self.first.port}"}).start()
        assert self.client.reconnected.wait(20), "the client did not reconnect on its own"
        assert self.client.generation == 1

    def close(self) -> None:
        self.client.close()
        self.first.kill()
        if self.second is not None:
            self.second.stop()


def test_agent_sigkill_client_notices_fails_and_recovers(qwen_ckpt: Path) -> None:
    from host_client import AgentUnavailable

    truth = checkpoint_bytes(qwen_ckpt)
    r = _Restartable(qwen_ckpt, "qr", 6)
    try:
        client, dev, model = r.client, r.dev, r.model
        client.acquire(dev, ExpertKey("qr", 0, 0)).wait(10)
        dev.device.pause()  # keep the next transfers in flight
        in_flight = client.acquire_batch(dev, [ExpertKey("qr", 1, e) for e in range(3)])
        r.first.kill()
        t0 = time.monotonic()
        for h in in_flight:
            with pytest.raises(AgentUnavailable):
                h.wait(5)
        assert time.monotonic() - t0 < 1.0, "the client took over 1 s to notice"
        r.restart()
        # Re-registered device, reloaded model: every slot verified against the checkpoint.
        keys = [ExpertKey("qr", layer, e) for layer in model.moe_layers for e in range(2)]
        for slot in (h.wait(10) for h in client.acquire_batch(dev, keys)):
            for role, name in _names(slot.key).items():
                assert slot.raw(role).tobytes() == truth[name], (slot.key, role)
    finally:
        r.close()


def test_graceful_restart_is_survived_like_a_kill(qwen_ckpt: Path) -> None:
    """SIGTERM (what systemctl restart sends) ends the event stream cleanly: the client must
    take that as the agent going away, idle while it is down (under 5 % of a core, its threads
    together, the device's consumer included; its event thread once spun at 100 % on the
    ended stream; they stay under 1 % as a rule, 2 % was seen once on a loaded 2-core VM) and
    recover exactly as after SIGKILL."""
    truth = checkpoint_bytes(qwen_ckpt)
    r = _Restartable(qwen_ckpt, "qt", 4)
    try:
        r.client.acquire(r.dev, ExpertKey("qt", 0, 0)).wait(10)
        assert r.first.stop() == 0
        time.sleep(0.5)  # the device consumer's idle back-off reaches its longest nap
        # The client's own threads (other tests' leftovers share this process, and gRPC's
        # event-engine threads serve every channel of it).
        mine = [t for t in threading.enumerate() if t.name in ("agent-events", "agent-lease")]
        mine.append(r.dev.device._thread)
        cpu0, t0 = sum(_thread_cpu(t) for t in mine), time.monotonic()
        time.sleep(3.0)
        busy = (sum(_thread_cpu(t) for t in mine) - cpu0) / (time.monotonic() - t0)
        assert busy < 0.05, f"the client's threads used {busy:.1%} of a core while down"
        r.restart()
        slot = r.client.acquire(r.dev, ExpertKey("qt", 0, 1)).wait(10)
        for role, name in _names(slot.key).items():
            assert slot.raw(role).tobytes() == truth[name], (slot.key, role)
    finally:
        r.close()


def test_restart_under_load_with_a_changed_config(qwen_ckpt: Path) -> None:
    """systemctl restart while four threads acquire and release, the new agent with another
    chunk size and arena: every thread sees only typed errors while the agent is away, none
    hangs, and each then gets the checkpoint's bytes from the new agent."""
    from host_client import AgentError

    truth = checkpoint_bytes(qwen_ckpt)
    r = _Restartable(qwen_ckpt, "ql", 8)
    stop = threading.Event()
    served: dict[int, list[int]] = {w: [] for w in range(4)}
    failures: list[BaseException] = []

    def work(w: int) -> None:
        n = 0
        while not stop.is_set():
            key = ExpertKey("ql", n % 3, (w + n) % 6)
            n += 1
            try:
                slot = r.client.acquire(r.dev, key).wait(10)
                for role, name in _names(key).items():
                    assert slot.raw(role).tobytes() == truth[name], (key, role)
                served[w].append(r.client.generation)
                r.client.release(r.dev, key)
            except AgentError:
                time.sleep(0.05)  # the agent is away: typed, and tried again
            except BaseException as exc:  # noqa: BLE001 - anything else fails the test
                failures.append(exc)
                return

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        assert r.first.stop() == 0  # SIGTERM: drain, then exit 0
        r.restart('[transfer]\nchunk_bytes = 65536\n[arena]\nbytes = "48MiB"\n')
        deadline = time.monotonic() + 20
        while not all(1 in gens for gens in served.values()) and not failures:
            assert time.monotonic() < deadline, {w: len(g) for w, g in served.items()}
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
        r.close()
    assert not failures, failures[:3]
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert all(0 in gens for gens in served.values()), "served before the restart too"


def _thread_cpu(thread: threading.Thread | None) -> float:
    """CPU seconds a thread of this process has used (Linux /proc schedstat, nanoseconds)."""
    if thread is None or thread.native_id is None:
        return 0.0
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def test_caller_gone_during_a_fill_leaves_no_reference(tmp_path: Path) -> None:
    """An AcquireBatch whose deadline passes while the agent fills the arena on a worker
    thread: the fill finishes, and the references the lost response carried are given back
    (otherwise they would stay until the session's lease ran out)."""
    import grpc

    from dpu_offload.v1 import agent_pb2 as pb
    from host_client.checkpoints import CheckpointSpec, make_checkpoint

    root = make_checkpoint(tmp_path / "big", CheckpointSpec(
        "qwen3-moe", layers=1, experts=8, hidden=2048, intermediate=768, dtype="bf16",
        dense_layers=0), layers_per_shard=1)
    with AgentProcess('[arena]\nbytes = "256MiB"\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(root), "big")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 8)])
        keys = [ExpertKey("big", model.moe_layers[0], e) for e in range(8)]
        with pytest.raises(grpc.RpcError) as err:  # 75 MB of fills cannot finish in 20 ms
            client.stub.AcquireBatch(pb.AcquireBatchRequest(
                session_id=client.session_id, device_id=dev.device_id,
                keys=[k.to_proto() for k in keys]), timeout=0.02)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 30
        while client.status().cache_misses < 8 or client.status().transfers_in_flight:
            assert time.monotonic() < deadline, "the fills did not finish"
            time.sleep(0.05)
        # The give-back runs once the fill thread has returned to the cancelled call.
        while client.status().sessions[0].slots_held:
            assert time.monotonic() < deadline, "the lost response's references stayed held"
            time.sleep(0.05)
        for k in keys:
            with pytest.raises(grpc.RpcError) as err:
                client.release(dev, k)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, k


@pytest.mark.gpu
def test_a_stream_wait_on_corrupted_bytes_fails_and_the_next_acquire_is_right(
        qwen_ckpt: Path) -> None:
    """The check on the caller's stream finds the mismatch: ``StreamWait.check`` raises (the
    kernels behind it already ran), the agent counts it and drops the arena's copy, and the
    next acquire refetches from the checkpoint."""
    import cupy as cp

    from host_client import TransferFailed

    truth = checkpoint_bytes(qwen_ckpt)
    settings = ('[arena]\nbytes = "64MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n')
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qs")
        key = ExpertKey("qs", 2, 1)
        warm = client.register_device(CpuReferenceDevice(0), [SlotPoolSpec(model.expert_bytes,
                                                                            2)])
        client.acquire(warm, key).wait(10)
        client.release(warm, key)
        arena = SharedBuffer(client.arena.shm_name, client.arena.size_bytes)
        arena.array[:int(_metric(agent, "dpu_agent_arena_used_bytes"))] ^= 0x01
        dev = _device("cuda", 0)
        gpu = client.register_device(dev, [SlotPoolSpec(model.expert_bytes, 2)],
                                     delivery="engine")
        stream = cp.cuda.Stream(non_blocking=True)
        wait = client.acquire(gpu, key).enqueue_wait(stream)
        with pytest.raises(TransferFailed, match="FAILED"):
            wait.check()
        deadline = time.monotonic() + 5
        while _metric(agent, "dpu_agent_checksum_failures_total") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        slot = client.acquire(gpu, key).wait(20)
        for role, name in _names(key).items():
            assert _host(slot.raw(role)) == truth[name], role
        arena.close()


def test_shards_changed_under_the_agent_degrade_the_model_not_the_agent(
        qwen_ckpt: Path, tmp_path: Path) -> None:
    """A shard shortened (a memory map would take SIGBUS) or rewritten after LoadModel: the
    experts it holds fail FAILED_PRECONDITION naming the file, the model is marked degraded in
    status and metrics, the agent and other models carry on; restored and loaded again, the
    model serves the files' bytes."""
    import shutil

    import grpc

    from host_client import FailedPrecondition

    root = tmp_path / "m"
    shutil.copytree(qwen_ckpt, root)
    truth = checkpoint_bytes(qwen_ckpt)
    settings = '[arena]\nbytes = "64MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n'
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(root), "changing")
        client.load_model(str(qwen_ckpt), "steady")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)])
        shards = sorted(root.glob("*.safetensors"))
        last = ExpertKey("changing", 2, 5)  # in the last shard
        data = shards[-1].read_bytes()
        shards[-1].write_bytes(data[: len(data) // 2])
        with pytest.raises(FailedPrecondition) as err:
            client.acquire(dev, last).wait(20)
        assert shards[-1].name in err.value.details() and "degraded" in err.value.details()
        status = {m.model: m.degraded for m in client.status().models}
        assert shards[-1].name in status["changing"] and status["steady"] == ""
        assert _metric(agent, "dpu_agent_model_degraded") == 1
        steady = client.acquire(dev, ExpertKey("steady", 2, 5)).wait(20)
        assert steady.raw("up_proj").tobytes() == \
            truth["model.layers.2.mlp.experts.5.up_proj.weight"]
        client.release(dev, ExpertKey("steady", 2, 5))
        # Same size, bytes rewritten in place: caught by the modification time.
        first = shards[0].read_bytes()
        time.sleep(0.01)
        shards[0].write_bytes(first[:-8] + bytes(8))
        with pytest.raises(FailedPrecondition, match=r"degraded: .* changed since load"):
            client.acquire(dev, ExpertKey("changing", 0, 5)).wait(20)
        # Restored and loaded again: served, equal to the files.
        shards[-1].write_bytes(data)
        shards[0].write_bytes(first)
        client.load_model(str(root), "changing")
        assert {m.model: m.degraded for m in client.status().models}["changing"] == ""
        slot = client.acquire(dev, last).wait(20)
        assert slot.raw("down_proj").tobytes() == \
            truth["model.layers.2.mlp.experts.5.down_proj.weight"]
        assert agent.proc.poll() is None
        assert isinstance(err.value, grpc.RpcError)


def test_bytes_changed_in_place_are_caught_by_the_ingest_manifest(qwen_ckpt: Path,
                                                                  tmp_path: Path) -> None:
    """Bytes rewritten with the size and modification time put back (no stamp shows it): with
    an ingest manifest beside the checkpoint, the fill's checksums differ from it, the expert
    fails FAILED_PRECONDITION and the model shows degraded; a manifest of another checkpoint is
    refused at LoadModel."""
    import os
    import shutil
    import subprocess
    import sys

    from host_client import FailedPrecondition, InvalidArgument

    root = tmp_path / "m"
    shutil.copytree(qwen_ckpt, root)
    res = subprocess.run([sys.executable, "-m", "dpu_agent.cli", "ingest", str(root),
                          "--chunk-bytes", "65536"], capture_output=True, text=True)
    assert res.returncode == 0 and (root / "dpu-manifest.json").exists(), res.stderr
    with AgentProcess('[arena]\nbytes = "64MiB"\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(root), "manifested")
        assert {m.model: m.manifest for m in client.status().models}["manifested"]
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)])
        client.acquire(dev, ExpertKey("manifested", 0, 0)).wait(20)  # checked, served
        from dpu_agent.weights.catalog import build_catalog

        t = build_catalog(root).experts[ExpertKey("m", 2, 5)].tensors[-1]
        shard = t.file
        st = shard.stat()
        data = bytearray(shard.read_bytes())
        data[t.file_offset + 64:t.file_offset + 96] = bytes(range(32))  # in expert l2-e5
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(FailedPrecondition, match="differs from manifest"):
            client.acquire(dev, ExpertKey("manifested", 2, 5)).wait(20)
        assert "manifest" in {m.model: m.degraded for m in client.status().models}["manifested"]
        other = tmp_path / "other"
        shutil.copytree(qwen_ckpt, other)
        manifest = (root / "dpu-manifest.json").read_text()
        (other / "dpu-manifest.json").write_text(manifest.replace('"blob_bytes": ',
                                                                  '"blob_bytes": 1', 1))
        with pytest.raises(InvalidArgument, match="does not describe expert"):
            client.load_model(str(other), "other")
        # A checksum that is not a 32-bit integer is refused the same way (it was an
        # unhandled ValueError).
        import re

        (other / "dpu-manifest.json").write_text(re.sub(
            r'"chunk_checksums": \[\d+', '"chunk_checksums": ["x"', manifest, count=1))
        with pytest.raises(InvalidArgument, match="does not describe expert"):
            client.load_model(str(other), "other")


def test_a_dead_processs_segments_are_swept_at_start_a_live_ones_kept(tmp_path: Path) -> None:
    """Shared-memory segments named by a process that is gone (a crashed agent's arena, a dead
    client's rings) are removed when an agent starts; a live process's are kept."""
    import os

    from dpu_offload.shm import SHM_DIR, unique_name

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [f"dpu-agent-arena-{dead.pid}-{'ab' * 16}", f"dpu-ring-work-{dead.pid}-{'cd' * 16}"]
    live = unique_name("dpu-channel")  # this test's pid: alive
    other = f"not-ours-{dead.pid}-{'ef' * 16}"
    for name in (*stale, live, other):
        Path(SHM_DIR, name).write_bytes(b"x")
    try:
        with AgentProcess() as agent:
            assert agent.proc.poll() is None
            assert not any(Path(SHM_DIR, n).exists() for n in stale)
            assert Path(SHM_DIR, live).exists() and Path(SHM_DIR, other).exists()
            assert "shared-memory segments left by dead processes" in agent.log()
    finally:
        for name in (*stale, live, other):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
