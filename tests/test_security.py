"""mTLS on gRPC (plaintext, foreign-CA and certificate-less clients refused), per-session
ownership (PERMISSION_DENIED), per-session concurrency, message size limits."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_offload import abi
from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, AgentUnavailable, CpuReferenceDevice, SlotPoolSpec, TlsFiles
from host_client.launcher import AgentProcess


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _leaf(d: Path, name: str, ca: str, san: str | None = None) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", str(ext),
             cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "otherca")
    _leaf(d, "agent", "ca", "IP:127.0.0.1,DNS:localhost")
    _leaf(d, "client", "ca")
    _leaf(d, "colleague", "ca")
    _leaf(d, "intruder", "otherca")
    return d


def test_mutual_tls_refuses_plaintext_foreign_ca_and_anonymous(pki: Path) -> None:
    settings = (f'[server]\ntls_cert = "{pki}/agent.pem"\ntls_key = "{pki}/agent.key"\n'
                f'tls_client_ca = "{pki}/ca.pem"\n')
    with AgentProcess(settings) as agent:
        good = TlsFiles(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
        with AgentClient(agent.address, tls=good) as client:
            assert client.status().version
        for tls in (None,
                    TlsFiles(str(pki / "ca.pem"), str(pki / "intruder.pem"),
                             str(pki / "intruder.key")),
                    TlsFiles(str(pki / "ca.pem"))):
            with pytest.raises(AgentUnavailable):
                AgentClient(agent.address, tls=tls, connect_timeout=1.5)


def test_under_mutual_tls_a_session_is_its_certificates(pki: Path) -> None:
    """A second valid certificate of the same CA holding the session's id and token is still
    PERMISSION_DENIED: the session is bound to the certificate that created it."""
    from dpu_offload.identity import SESSION_TOKEN_METADATA
    from dpu_offload.v1 import agent_pb2_grpc

    settings = (f'[server]\ntls_cert = "{pki}/agent.pem"\ntls_key = "{pki}/agent.key"\n'
                f'tls_client_ca = "{pki}/ca.pem"\n')
    with AgentProcess(settings) as agent:
        files = {"client": TlsFiles(str(pki / "ca.pem"), str(pki / "client.pem"),
                                    str(pki / "client.key"))}
        with AgentClient(agent.address, tls=files["client"]) as owner:
            stolen = [(SESSION_TOKEN_METADATA, owner.session_token)]
            creds = grpc.ssl_channel_credentials(
                (pki / "ca.pem").read_bytes(), (pki / "colleague.key").read_bytes(),
                (pki / "colleague.pem").read_bytes())
            with grpc.secure_channel(agent.address, creds) as ch:
                stub = agent_pb2_grpc.DpuAgentStub(ch)
                with pytest.raises(grpc.RpcError) as err:
                    stub.KeepAlive(pb.SessionRef(session_id=owner.session_id),
                                   metadata=stolen, timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            owner.stub.KeepAlive(pb.SessionRef(session_id=owner.session_id), timeout=5)
            creds = grpc.ssl_channel_credentials(
                (pki / "ca.pem").read_bytes(), (pki / "client.key").read_bytes(),
                (pki / "client.pem").read_bytes())
            with grpc.secure_channel(agent.address, creds) as ch:  # same certificate: admitted
                agent_pb2_grpc.DpuAgentStub(ch).KeepAlive(
                    pb.SessionRef(session_id=owner.session_id), metadata=stolen, timeout=5)


def test_unreadable_certificate_is_a_startup_error(tmp_path: Path) -> None:
    agent = AgentProcess(f'[server]\ntls_cert = "{tmp_path}/none.pem"\n'
                         f'tls_key = "{tmp_path}/none.key"\n')
    with pytest.raises(RuntimeError, match=r"server\.tls_cert: .*none\.pem is not a readable"):
        agent.start()


def test_another_sessions_device_is_permission_denied(agent: AgentProcess) -> None:
    with AgentClient(agent.address) as owner, AgentClient(agent.address) as other:
        dev = owner.register_device(CpuReferenceDevice(), [SlotPoolSpec(1 << 16, 1)])
        with pytest.raises(grpc.RpcError) as err:
            other.stub.Acquire(pb.AcquireRequest(session_id=other.session_id,
                                                 device_id=dev.device_id,
                                                 key=pb.ExpertKey(model="m", layer=0, expert=0)))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_oversized_message_is_refused(agent: AgentProcess) -> None:
    with AgentClient(agent.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.stub.LoadModel(pb.LoadModelRequest(path="x" * (17 << 20)), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_calls_beyond_the_session_bound_are_resource_exhausted(tmp_path: Path) -> None:
    import threading
    import time

    from dpu_offload.keys import ExpertKey
    from host_client.checkpoints import CheckpointSpec, make_checkpoint

    root = make_checkpoint(tmp_path / "big", CheckpointSpec("qwen3-moe", layers=1, experts=8,
                                                            hidden=2048, intermediate=1536))
    with AgentProcess('[sessions]\nmax_concurrent_rpcs = 1\n[arena]\nbytes = "512MiB"\n'
                      ) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(root), "big")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 8)])
        # The bound is on gRPC calls (the channel's bound is its ring): the control-plane
        # AcquireBatch / Acquire that tools may still use.
        def rpc_acquire(experts: range) -> None:
            client.stub.AcquireBatch(pb.AcquireBatchRequest(
                session_id=client.session_id, device_id=dev.device_id,
                keys=[ExpertKey("big", 0, e).to_proto() for e in experts]), timeout=30)
        slow = threading.Thread(target=rpc_acquire, args=(range(8),))  # cold fills: 100s of ms
        slow.start()
        time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            rpc_acquire(range(1))
        slow.join()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_rpcs" in err.value.details()
        client.acquire(dev, ExpertKey("big", 0, 1)).wait(10)  # the bound frees up again


def test_curve_on_the_activation_socket(tmp_path: Path) -> None:
    import zmq
    import zmq.auth

    from dpu_offload import frames
    from host_client.activations import curve_socket

    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    zmq.auth.create_certificates(str(keys), "agent")
    zmq.auth.create_certificates(str(keys), "sender")
    zmq.auth.create_certificates(str(keys), "stranger")
    (clients / "sender.key").write_bytes((keys / "sender.key").read_bytes())
    settings = (f'[activations]\nlisten_address = "127.0.0.1:0"\n'
                f'curve_server_cert = "{keys}/agent.key_secret"\n'
                f'curve_clients_dir = "{clients}"\n')
    with AgentProcess(settings) as agent:
        address = f"tcp://127.0.0.1:{agent.activations_port}"

        def ask(curve: tuple[str, str] | None) -> bool:
            sock = curve_socket(zmq.DEALER, curve)
            try:
                sock.connect(address)
                sock.send_multipart([b"\0" * 64, b""])  # any frame: answered BAD_FRAME
                if not sock.poll(1500):
                    return False
                h, p = sock.recv_multipart()
                return frames.unpack(h, len(p)).status == frames.FrameStatus.BAD_FRAME
            finally:
                sock.close(0)

        assert ask((str(keys / "sender.key_secret"), str(keys / "agent.key")))
        assert not ask((str(keys / "stranger.key_secret"), str(keys / "agent.key")))
        assert not ask(None)


def test_a_session_cannot_be_named_by_another_caller(agent: AgentProcess,
                                                     qwen_ckpt: Path) -> None:
    """Every RPC that names a session, called with another session's id (which status lists)
    under the caller's own token, or with no token at all: PERMISSION_DENIED, and the owner's
    session, held slot, device and event stream are untouched (issue 21)."""
    from google.protobuf import message_factory

    from dpu_offload.keys import ExpertKey
    from dpu_offload.v1 import agent_pb2_grpc
    from host_client import CpuReferenceDevice, SlotPoolSpec

    service = pb.DESCRIPTOR.services_by_name["DpuAgent"]
    with AgentClient(agent.address) as owner, AgentClient(agent.address) as thief:
        model = owner.load_model(str(qwen_ckpt), "owned")
        dev = owner.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        key = ExpertKey("owned", model.moe_layers[0], 0)
        held = owner.acquire(dev, key).wait(10)
        anonymous = agent_pb2_grpc.DpuAgentStub(grpc.insecure_channel(agent.address))
        named = 0
        for method in service.methods:
            if "session_id" not in method.input_type.fields_by_name:
                continue
            request = message_factory.GetMessageClass(method.input_type)()
            request.session_id = owner.session_id
            fields = method.input_type.fields_by_name
            if "device_id" in fields:
                request.device_id = dev.device_id
            if "model" in fields and fields["model"].type == fields["model"].TYPE_STRING:
                request.model = "owned"
            if "key" in fields:
                request.key.CopyFrom(key.to_proto())
            if "keys" in fields:
                request.keys.append(key.to_proto())
            for stub in (thief.stub, anonymous):
                call = getattr(stub, method.name)
                with pytest.raises(grpc.RpcError) as err:
                    out = call(request, timeout=5)
                    if method.server_streaming:
                        next(iter(out))
                    pytest.fail(f"{method.name} answered OK for another caller")
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, \
                    (method.name, err.value.code(), err.value.details())
            named += 1
        assert named >= 12
        mine = next(s for s in owner.status().sessions if s.session_id == owner.session_id)
        assert mine.slots_held == 1
        assert held.raw("gate_proj").tobytes() == owner.acquire(dev, key).wait(10) \
            .raw("gate_proj").tobytes()
        owner.release(dev, key)
        owner.release(dev, key)
        assert owner.placement_progress(0) is None  # the owner's event thread is still its own
        assert owner._event_thread.is_alive()


def test_another_sessions_rings_cannot_be_registered(agent: AgentProcess,
                                                      qwen_ckpt: Path) -> None:
    """A session that names another session's work, completion, rx or tx ring (their names
    are listed in /dev/shm) is refused PERMISSION_DENIED and registers nothing; the owner's
    slots still fill with the checkpoint's bytes through its own rings (issue 21: the thief
    once acquired into the victim's rings and wrote another expert over a READY slot)."""
    from dpu_offload.keys import ExpertKey
    from tests.conftest import checkpoint_bytes

    truth = checkpoint_bytes(qwen_ckpt)
    with AgentClient(agent.address) as victim, AgentClient(agent.address) as thief:
        model = victim.load_model(str(qwen_ckpt), "owned")
        vdev = victim.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        tdev = thief.stub.RegisterDevice(pb.RegisterDeviceRequest(
            session_id=thief.session_id, kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=0),
            timeout=10)
        for ring, kind in ((vdev.work, pb.REGION_KIND_WORK_RING),
                           (vdev.completion, pb.REGION_KIND_COMPLETION_RING),
                           (vdev.rx, pb.REGION_KIND_RX_RING), (vdev.tx, pb.REGION_KIND_TX_RING)):
            with pytest.raises(grpc.RpcError) as err:
                thief.stub.RegisterRegion(pb.RegisterRegionRequest(
                    session_id=thief.session_id, device_id=tdev.device_id, kind=kind,
                    size_bytes=ring.size, shm_name=ring.name), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (kind, err.value)
            assert ring.name in err.value.details()
            assert "not created for this session" in err.value.details()
        assert not [s for s in thief.status().sessions
                    if s.session_id == thief.session_id and s.regions]
        key = ExpertKey("owned", model.moe_layers[0], 1)
        slot = victim.acquire(vdev, key).wait(10)
        name = f"model.layers.{key.layer}.mlp.experts.1.up_proj.weight"
        assert slot.raw("up_proj").tobytes() == truth[name]


def test_status_shows_a_caller_its_own_sessions_and_an_administrator_all(pki: Path) -> None:
    """GetStatus lists the sessions the caller's token and certificate own; the rest only as a
    count, except to a certificate named in server.admin_names."""
    settings = (f'[server]\ntls_cert = "{pki}/agent.pem"\ntls_key = "{pki}/agent.key"\n'
                f'tls_client_ca = "{pki}/ca.pem"\nadmin_names = ["client"]\n')
    with AgentProcess(settings) as agent:
        admin = TlsFiles(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
        user = TlsFiles(str(pki / "ca.pem"), str(pki / "colleague.pem"),
                        str(pki / "colleague.key"))
        with AgentClient(agent.address, tls=admin, client_name="ops") as ops, \
                AgentClient(agent.address, tls=user, client_name="colleague") as colleague:
            mine = colleague.status()
            assert [s.client_name for s in mine.sessions] == ["colleague"]
            assert mine.other_sessions == 1
            everything = ops.status()
            assert sorted(s.client_name for s in everything.sessions) == ["colleague", "ops"]
            assert everything.other_sessions == 0


def test_expertctl_reaches_an_agent_that_requires_mutual_tls(pki: Path) -> None:
    """expertctl's status and flows speak TLS with --tls-ca / --tls-cert / --tls-key (or
    $EXPERTCTL_TLS_*): plaintext is refused by the agent, the client's certificate gets its
    answer (an administrator's: every session), and a file it cannot read is named."""
    import os
    import sys

    settings = (f'[server]\ntls_cert = "{pki}/agent.pem"\ntls_key = "{pki}/agent.key"\n'
                f'tls_client_ca = "{pki}/ca.pem"\nadmin_names = ["client"]\n')

    def expertctl(*args: str, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "host_client.cli", *args],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, **(env or {})})

    files = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"),
             "--tls-key", str(pki / "client.key")]
    with AgentProcess(settings) as agent:
        user = TlsFiles(str(pki / "ca.pem"), str(pki / "colleague.pem"),
                        str(pki / "colleague.key"))
        with AgentClient(agent.address, tls=user, client_name="bob"):
            plain = expertctl("status", "--agent", agent.address, "--timeout", "3")
            assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
            ok = expertctl("status", "--agent", agent.address, *files)
            assert ok.returncode == 0, ok.stderr
            assert "bob" in ok.stdout  # an administrator sees every session
            env = {"EXPERTCTL_TLS_CA": str(pki / "ca.pem"),
                   "EXPERTCTL_TLS_CERT": str(pki / "client.pem"),
                   "EXPERTCTL_TLS_KEY": str(pki / "client.key")}
            flows = expertctl("flows", "--agent", agent.address, "list", env=env)
            assert flows.returncode == 0 and "flow table v" in flows.stdout, flows.stderr
        missing = expertctl("status", "--agent", agent.address, "--tls-ca",
                            str(pki / "none.pem"))
        assert missing.returncode == 1
        assert f"--tls-ca '{pki / 'none.pem'}' is not a readable file" in missing.stderr
        half = expertctl("status", "--agent", agent.address, "--tls-ca", str(pki / "ca.pem"),
                         "--tls-cert", str(pki / "client.pem"))
        assert half.returncode == 1 and "--tls-cert and --tls-key together" in half.stderr


def test_administrators_need_client_certificates(tmp_path: Path) -> None:
    agent = AgentProcess('[server]\nadmin_names = ["ops"]\n')
    with pytest.raises(RuntimeError, match=r"server\.admin_names: .*tls_client_ca"):
        agent.start()


def test_a_segment_is_registered_only_by_the_session_it_was_named_for(
        agent: AgentProcess) -> None:
    """A thief that reads a segment's name in /dev/shm before its creator registers it (or
    any name it made up) is refused: the name must be bound to the registering session's
    token (``shm.session_name``). The creator registers it afterwards, unhindered."""
    from host_client.memory import SharedRing

    with AgentClient(agent.address) as owner, AgentClient(agent.address) as thief:
        devices = [c.stub.RegisterDevice(pb.RegisterDeviceRequest(
            session_id=c.session_id, kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=0),
            timeout=10).device_id for c in (owner, thief)]
        fresh = SharedRing(abi.RingKind.RX_PACKET, 16, 256, token=owner.session_token)
        unbound = SharedRing(abi.RingKind.RX_PACKET, 16, 256)
        try:
            for ring in (fresh, unbound):
                with pytest.raises(grpc.RpcError) as err:
                    thief.stub.RegisterRegion(pb.RegisterRegionRequest(
                        session_id=thief.session_id, device_id=devices[1],
                        kind=pb.REGION_KIND_RX_RING, size_bytes=ring.size, shm_name=ring.name),
                        timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert ring.name in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                owner.stub.RegisterRegion(pb.RegisterRegionRequest(
                    session_id=owner.session_id, device_id=devices[0],
                    kind=pb.REGION_KIND_RX_RING, size_bytes=unbound.size,
                    shm_name=unbound.name), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert owner.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=owner.session_id, device_id=devices[0], kind=pb.REGION_KIND_RX_RING,
                size_bytes=fresh.size, shm_name=fresh.name), timeout=10).region_id >= 0
        finally:
            fresh.close()
            unbound.close()


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_a_session_name_is_bound_to_its_token_only(mine: str, theirs: str) -> None:
    """``session_name`` gives a name ``bound_to`` the digest of its token and of no other;
    the name keeps the form the start-up sweep of a dead creator's segments reads."""
    import os
    import re

    from dpu_offload.shm import bound_to, session_name, token_digest

    name = session_name("dpu-ring-work", mine)
    assert bound_to(name, token_digest(mine))
    assert bound_to(name, token_digest(theirs)) == (mine == theirs)
    assert re.fullmatch(rf"dpu-ring-work-{os.getpid()}-[0-9a-f]+", name)
    tampered = name[:-1] + ("0" if name[-1] != "0" else "1")
    assert not bound_to(tampered, token_digest(mine))
    assert not bound_to("x", token_digest(mine))
    assert not bound_to(name[:-3] + mine[:3], token_digest(mine))  # any characters: False


def test_a_region_named_in_any_characters_is_refused_by_name(agent: AgentProcess) -> None:
    """A hostile ``shm_name`` of non-ASCII characters is PERMISSION_DENIED like any name not
    made for the session (it once escaped as INTERNAL: ``hmac.compare_digest`` refuses
    non-ASCII str)."""
    with AgentClient(agent.address) as client:
        dev = client.stub.RegisterDevice(pb.RegisterDeviceRequest(
            session_id=client.session_id, kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=0),
            timeout=10)
        for name in ("é" * 40, "dpu-ring-rx-1-" + "ü" * 48, "x"):
            with pytest.raises(grpc.RpcError) as err:
                client.stub.RegisterRegion(pb.RegisterRegionRequest(
                    session_id=client.session_id, device_id=dev.device_id,
                    kind=pb.REGION_KIND_RX_RING, size_bytes=4096, shm_name=name), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name


def test_a_handle_under_registration_is_refused_to_another_session(agent: AgentProcess,
                                                                   qwen_ckpt: Path) -> None:
    """A slot pool's registration waits on the DMA engine to open it (the engine is stopped
    here; on a GPU host a CUDA IPC open takes time) before it shows among the registered
    regions. Meanwhile another session naming the same CUDA IPC handle is refused
    PERMISSION_DENIED at once, as it is once the first is registered; the first completes
    when the engine resumes."""
    import os
    import signal
    import threading

    from bench.common import child_pids
    from dpu_offload.keys import ExpertKey
    from dpu_offload.shm import SharedBuffer, session_name

    handle = bytes(range(64))
    with AgentClient(agent.address) as first, AgentClient(agent.address) as second:
        model = first.load_model(str(qwen_ckpt), "claimed")
        running = first.register_device(CpuReferenceDevice(20),
                                        [SlotPoolSpec(model.expert_bytes, 2)], delivery="engine")
        first.acquire(running, ExpertKey("claimed", model.moe_layers[0], 0)).wait(10)
        (engine,) = child_pids(agent.proc.pid, "dma_engine")
        pools, requests = [], []
        for client in (first, second):
            dev = client.stub.RegisterDevice(pb.RegisterDeviceRequest(
                session_id=client.session_id, kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=21,
                delivery=pb.DELIVERY_DMA_ENGINE), timeout=10)
            pools.append(SharedBuffer(session_name("dpu-pool", client.session_token),
                                      model.expert_bytes, create=True))
            requests.append(pb.RegisterRegionRequest(
                session_id=client.session_id, device_id=dev.device_id,
                kind=pb.REGION_KIND_SLOT_POOL, size_bytes=model.expert_bytes,
                slot_bytes=model.expert_bytes, slot_count=1, shm_name=pools[-1].name,
                cuda_ipc_handle=handle))
        answers: list[object] = []
        os.kill(engine, signal.SIGSTOP)
        try:
            opening = threading.Thread(target=lambda: answers.append(
                first.stub.RegisterRegion(requests[0], timeout=20)))
            opening.start()
            time.sleep(0.5)
            assert opening.is_alive()
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                second.stub.RegisterRegion(requests[1], timeout=10)
            assert time.monotonic() - t0 < 2
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
            assert "that CUDA IPC handle is already" in err.value.details()
        finally:
            os.kill(engine, signal.SIGCONT)
        opening.join(20)
        assert len(answers) == 1 and answers[0].region_id > 0
        with pytest.raises(grpc.RpcError) as err:  # and once it is registered
            second.stub.RegisterRegion(requests[1], timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        for pool in pools:
            pool.close()
            pool.unlink()
