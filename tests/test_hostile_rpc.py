"""Bodies that do not decode, and the standard services, against a real agent: no call may end
UNKNOWN (or INTERNAL for bad input), and the agent stays SERVING (issue 21)."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dpu_offload.v1 import agent_pb2 as pb
from dpu_offload.v1 import agent_pb2_grpc
from host_client.launcher import AgentProcess

SERVICE = pb.DESCRIPTOR.services_by_name["DpuAgent"]


def _undecodable(rng: random.Random) -> list[bytes]:
    """Bodies no protobuf message parses: a truncated varint, a length past the end, a field
    number 0, an end-group tag with no group, and random noise that happens not to parse."""
    fixed = [b"\x08", b"\x0a\xff\x01ab", b"\x00\x01", b"\x0c", b"\xff" * 11]
    return fixed + [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
                    for _ in range(20)]


def test_undecodable_bodies_are_invalid_argument_on_every_method(agent: AgentProcess) -> None:
    rng = random.Random(21)
    bodies = _undecodable(rng)
    seen = 0
    with grpc.insecure_channel(agent.address) as ch:
        for method in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{method.name}"
            call = (ch.unary_stream if method.server_streaming else ch.unary_unary)(path)
            for body in bodies:
                try:
                    out = call(body, timeout=5)
                    if method.server_streaming:
                        next(iter(out), None)
                except grpc.RpcError as exc:
                    assert exc.code() not in (grpc.StatusCode.UNKNOWN,
                                              grpc.StatusCode.INTERNAL), \
                        (method.name, body, exc.code(), exc.details())
                    seen += exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert seen >= len(SERVICE.methods)  # the fixed bodies do not decode as any message


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_services(agent: AgentProcess,
                                                     version: str) -> None:
    """Server reflection answers under both names clients use (grpcurl tries v1 first): the
    service list, and the file that defines the agent's service."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    path = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(agent.address) as ch:
        call = ch.stream_stream(path, request_serializer=rpb.ServerReflectionRequest.
                                SerializeToString,
                                response_deserializer=rpb.ServerReflectionResponse.FromString)
        listed, described = call(iter([
            rpb.ServerReflectionRequest(list_services=""),
            rpb.ServerReflectionRequest(file_containing_symbol=SERVICE.full_name)]), timeout=5)
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE.full_name, "grpc.health.v1.Health"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "dpu_offload.v1" and
               "DpuAgent" in [svc.name for svc in f.service] for f in files)


def test_health_watch_streams_the_status(agent: AgentProcess) -> None:
    with grpc.insecure_channel(agent.address) as ch:
        stream = health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=5)
        first = next(iter(stream))
        stream.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("body", [b"\x08", b"\x0a\xff\x01ab"])
def test_a_body_that_does_not_decode_names_the_message(agent: AgentProcess,
                                                        body: bytes) -> None:
    with grpc.insecure_channel(agent.address) as ch, pytest.raises(grpc.RpcError) as err:
        ch.unary_unary(f"/{SERVICE.full_name}/GetStatus")(body, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "StatusRequest" in err.value.details()


@pytest.mark.parametrize("path,name,what", [
    ("/tmp/" + "x" * 300, "", "component longer than 255 bytes"),
    ("/tmp/" + "a/" * 3000, "m", "longer than 4096 bytes"),
    ("/tmp/\0bad", "m", "NUL"),
    ("/tmp/ok", "bad\nname", "whitespace or a non-printable"),
    ("/tmp/ok", "n\0", "non-printable"),
    ("/tmp/ok", "m" * 1_000_000, "more than 128"),
])
def test_load_model_bounds_paths_and_names(agent: AgentProcess, path: str, name: str,
                                           what: str) -> None:
    """Each is INVALID_ARGUMENT naming what was wrong, quoting at most a short prefix of the
    input, and nothing is loaded."""
    with grpc.insecure_channel(agent.address,
                               options=[("grpc.max_send_message_length", 4 << 20)]) as ch:
        stub = agent_pb2_grpc.DpuAgentStub(ch)
        before = list(stub.GetStatus(pb.StatusRequest(), timeout=5).models)
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadModel(pb.LoadModelRequest(path=path, name=name), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert what in err.value.details()
        assert len(err.value.details()) < 300
        assert list(stub.GetStatus(pb.StatusRequest(), timeout=5).models) == before


def test_an_exception_that_escapes_a_handler_is_internal_with_a_request_id(
        caplog: pytest.LogCaptureFixture) -> None:
    """The guard's last resort, on a real aio server on loopback: a handler that raises
    (unary and streaming) answers INTERNAL naming the request id the log line carries."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from dpu_agent.service.interceptors import GuardInterceptor, MetricsInterceptor

    async def boom(request: bytes, context: object) -> bytes:
        raise RuntimeError("defect")

    async def boom_stream(request: bytes, context: object):
        yield b"x"
        raise RuntimeError("defect")

    handlers = grpc.method_handlers_generic_handler("t.T", {
        "U": grpc.unary_unary_rpc_method_handler(boom),
        "S": grpc.unary_stream_rpc_method_handler(boom_stream)})

    async def run() -> list[grpc.aio.AioRpcError]:
        server = grpc.aio.server(interceptors=[MetricsInterceptor(CollectorRegistry()),
                                               GuardInterceptor()])
        server.add_generic_rpc_handlers((handlers,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        errors = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for call in (ch.unary_unary("/t.T/U")(b""),):
                try:
                    await call
                except grpc.aio.AioRpcError as exc:
                    errors.append(exc)
            try:
                async for _ in ch.unary_stream("/t.T/S")(b""):
                    pass
            except grpc.aio.AioRpcError as exc:
                errors.append(exc)
        await server.stop(None)
        return errors

    with caplog.at_level("ERROR", logger="dpu_agent"):
        errors = asyncio.run(run())
    assert [e.code() for e in errors] == [grpc.StatusCode.INTERNAL] * 2
    for e in errors:
        rid = e.details().split("request ")[1].split(",")[0]
        assert any(rid in r.getMessage() and "RuntimeError" in r.getMessage()
                   for r in caplog.records), (rid, [r.getMessage() for r in caplog.records])


def test_file_modes_state_dir_private_checkpoint_readable(tmp_path: Path) -> None:
    """The agent's state directory is 0700 (it names checkpoints and devices); a written
    checkpoint is 0644 files in a 0755 directory even under a umask of 077, so an agent
    running as its own service user can read it."""
    import os
    import stat

    from dpu_agent.state import StateStore
    from host_client.checkpoints import CheckpointSpec, make_checkpoint

    loose = tmp_path / "state"
    loose.mkdir(mode=0o755)
    StateStore(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    unit = (Path(__file__).parent.parent / "systemd" / "dpu-agent.service").read_text()
    assert "StateDirectoryMode=0700" in unit.splitlines()
    old = os.umask(0o077)
    try:
        root = make_checkpoint(tmp_path / "ckpt", CheckpointSpec(
            "qwen3-moe", layers=1, experts=2, hidden=64, intermediate=32, dense_layers=0))
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    files = list(root.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files), \
        {f.name: oct(f.stat().st_mode) for f in files}


def test_batch_calls_bound_their_keys_before_any_work(agent: AgentProcess,
                                                      qwen_ckpt: Path) -> None:
    """AcquireBatch, Prefetch and DescribeExperts name at most MAX_KEYS_PER_CALL keys: one
    more is INVALID_ARGUMENT at once (100,000 keys once stalled every client for seconds on the
    event loop), and nothing is held or queued."""
    from dpu_offload.keys import MAX_KEYS_PER_CALL, ExpertKey
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec

    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "bounded")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        keys = [ExpertKey("bounded", model.moe_layers[0], 0).to_proto()] * (MAX_KEYS_PER_CALL + 1)
        for call, request in (
                (client.stub.AcquireBatch, pb.AcquireBatchRequest(
                    session_id=client.session_id, device_id=dev.device_id, keys=keys)),
                (client.stub.Prefetch, pb.PrefetchRequest(
                    session_id=client.session_id, device_id=dev.device_id, keys=keys)),
                (client.stub.DescribeExperts, pb.DescribeExpertsRequest(
                    session_id=client.session_id, keys=keys))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {MAX_KEYS_PER_CALL}" in err.value.details()
        mine = next(s for s in client.status().sessions if s.session_id == client.session_id)
        assert mine.slots_held == 0 and mine.slots_ready == 0


@pytest.mark.parametrize("specs,capacity,named", [
    ([(-256, 2)], 1024, "slot_bytes a positive multiple of 256"),
    ([(4096, 0)], 1024, "slot_count > 0"),
    ([(300, 2)], 1024, "slot_bytes a positive multiple of 256"),
    ([(256, 16000), (256, 400)], 1024, "16400 slots: a device's pools hold at most 16384"),
    ([(4096, 2)], 1000, "ring capacity must be a power of two"),
    ([(4096, 2)], 2**21, "ring capacity must be a power of two up to"),
])
def test_a_device_registration_it_cannot_make_registers_nothing(
        agent: AgentProcess, specs: list[tuple[int, int]], capacity: int, named: str) -> None:
    """A slot pool or ring the agent would refuse (or this process could not make) is refused
    by the client before RegisterDevice: the same device registers once the arguments are
    right (a device registered first and refused after would be ALREADY_EXISTS here)."""
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
    from host_client.errors import InvalidArgument

    with AgentClient(agent.address) as client:
        with pytest.raises(InvalidArgument, match=named):
            client.register_device(CpuReferenceDevice(7), [SlotPoolSpec(*s) for s in specs],
                                   ring_capacity=capacity)
        dev = client.register_device(CpuReferenceDevice(7), [SlotPoolSpec(4096, 2)])
        assert dev.device_id >= 0 and len(dev.pools) == 1


def test_a_key_outside_the_request_fields_is_refused_by_the_client(agent: AgentProcess,
                                                                   qwen_ckpt: Path) -> None:
    from dpu_offload import abi
    from dpu_offload.keys import ExpertKey
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
    from host_client.errors import InvalidArgument

    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "keys")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        layer = model.moe_layers[0]
        for key in (ExpertKey("keys", -1, 0), ExpertKey("keys", layer, abi.MAX_KEY_FIELD + 1)):
            with pytest.raises(InvalidArgument, match="layer and expert must be from 0"):
                client.acquire(dev, key)
            with pytest.raises(InvalidArgument, match="layer and expert must be from 0"):
                client.release_batch(dev, [key])
        client.acquire(dev, ExpertKey("keys", layer, 0)).wait(30)  # the channel still serves


def test_a_routing_report_is_bounded_before_any_work(agent: AgentProcess,
                                                    qwen_ckpt: Path) -> None:
    """ReportRouting carries at most MAX_STEPS_PER_REPORT steps: one more is INVALID_ARGUMENT
    naming the bound and folds nothing into the routing statistics; exactly the bound is
    taken whole (the agent's own visit counter)."""
    from bench.common import scrape
    from dpu_offload.keys import MAX_STEPS_PER_REPORT
    from host_client import AgentClient

    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "reported")
        step = pb.RoutingStep(layer=model.moe_layers[0], experts=[0], tokens=[1])
        metric = "dpu_agent_routing_visits_total/reported"
        before = scrape(agent).get(metric, 0.0)
        with pytest.raises(grpc.RpcError) as err:
            client.stub.ReportRouting(pb.ReportRoutingRequest(
                session_id=client.session_id, model="reported",
                steps=[step] * (MAX_STEPS_PER_REPORT + 1)), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_STEPS_PER_REPORT}" in err.value.details()
        assert scrape(agent).get(metric, 0.0) == before
        client.stub.ReportRouting(pb.ReportRoutingRequest(
            session_id=client.session_id, model="reported",
            steps=[step] * MAX_STEPS_PER_REPORT), timeout=30)
        assert scrape(agent)[metric] - before == MAX_STEPS_PER_REPORT


def test_unknown_device_and_region_kinds_are_refused_by_name(agent: AgentProcess) -> None:
    """RegisterDevice with a device kind or delivery the protocol does not define, and
    RegisterRegion with an unknown region kind, are INVALID_ARGUMENT naming the value (the
    service layer's translation into the core's types), and register nothing."""
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec

    with AgentClient(agent.address) as client:
        for request, named in (
                (pb.RegisterDeviceRequest(session_id=client.session_id, kind=99, ordinal=5),
                 "device kind 99"),
                (pb.RegisterDeviceRequest(session_id=client.session_id,
                                          kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=5,
                                          delivery=7), "delivery 7")):
            with pytest.raises(grpc.RpcError) as err:
                client.stub.RegisterDevice(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert named in err.value.details()
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(1 << 16, 1)])

        def mine() -> pb.SessionStatus:
            return next(s for s in client.status().sessions
                        if s.session_id == client.session_id)

        regions = mine().regions
        with pytest.raises(grpc.RpcError) as err:
            client.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=client.session_id, device_id=dev.device_id, kind=42,
                size_bytes=1 << 16, slot_bytes=1 << 16, slot_count=1), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "region kind 42" in err.value.details()
        assert mine().devices == 1 and mine().regions == regions


def test_a_huge_name_is_refused_for_what_it_is_not_for_its_size(agent: AgentProcess) -> None:
    """A 1 MB model name or session id: the refusal names what is wrong (NOT_FOUND), its
    message cut short, instead of RESOURCE_EXHAUSTED from details over gRPC's limit."""
    from host_client import AgentClient

    big = "m" * 1_000_000
    with AgentClient(agent.address) as c:
        for call, request in (
                (c.stub.DescribeExperts, pb.DescribeExpertsRequest(
                    session_id=c.session_id, keys=[pb.ExpertKey(model=big)])),
                (c.stub.ReportRouting, pb.ReportRoutingRequest(session_id=c.session_id,
                                                               model=big)),
                (c.stub.ApplyPlacement, pb.ApplyPlacementRequest(session_id=c.session_id,
                                                                 model=big)),
                (c.stub.Rebalance, pb.RebalanceRequest(session_id=c.session_id, model=big)),
                (c.stub.KeepAlive, pb.SessionRef(session_id=big))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()[:200]
            assert len(err.value.details()) < 1100


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_hostile_client_is_bounded_in_sessions_devices_and_memory() -> None:
    """Sessions and devices (each device has a channel in shared memory) are bounded by the
    config: past the bound RESOURCE_EXHAUSTED naming it, and a closed session frees its place.
    Hammering every method with undecodable bodies leaves the agent's memory where it was."""
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
    from host_client.errors import ResourceExhausted

    settings = "[sessions]\nmax_sessions = 3\nmax_devices = 2\n"
    with AgentProcess(settings) as agent:
        clients = [AgentClient(agent.address, client_name=f"c{i}") for i in range(3)]
        try:
            with pytest.raises(ResourceExhausted, match=r"3 sessions are open.*max_sessions"):
                AgentClient(agent.address, client_name="one too many")
            pools = [SlotPoolSpec(1 << 16, 2)]
            devs = [clients[0].register_device(CpuReferenceDevice(i), pools) for i in range(2)]
            assert len(devs) == 2
            with pytest.raises(ResourceExhausted, match=r"2 devices.*max_devices"):
                clients[0].register_device(CpuReferenceDevice(2), pools)
            clients.pop().close()
            clients.append(AgentClient(agent.address, client_name="after a close"))
        finally:
            for c in clients:
                c.close()
        assert agent.proc is not None
        rng = random.Random(5)
        bodies = _undecodable(rng)
        with grpc.insecure_channel(agent.address) as ch:
            calls = [(ch.unary_stream if m.server_streaming else ch.unary_unary)(
                f"/{SERVICE.full_name}/{m.name}") for m in SERVICE.methods]

            def hammer(rounds: int) -> None:
                for _ in range(rounds):
                    for call in calls:
                        for body in bodies[:6]:
                            with contextlib.suppress(grpc.RpcError):
                                out = call(body, timeout=5)
                                if not isinstance(out, bytes):
                                    next(iter(out), None)

            hammer(3)  # warm: the allocator and gRPC's pools reach their working size
            before = _rss_kib(agent.proc.pid)
            hammer(30)
            grown = _rss_kib(agent.proc.pid) - before
        assert grown < 16 * 1024, f"agent RSS grew {grown} KiB under undecodable calls"


def test_an_unread_event_stream_is_bounded_and_counted(agent: AgentProcess,
                                                       qwen_ckpt: Path) -> None:
    """A client that opens its Events stream and never reads it, while its prefetches fail
    by the thousand (one error event each): the agent keeps at most the sink's capacity of
    them (the oldest dropped, counted in dpu_agent_session_events_dropped_total), so its
    memory does not grow with what the client ignores; the session's end still reaches the
    stream, after the newest events. Every event is accounted for: read by the client's own
    reader (those emitted before the second stream attached), by the second stream, or
    dropped."""
    from dpu_offload.keys import ExpertKey
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
    from tests.test_engine import metric

    class Counting(AgentClient):
        own = 0

        def _on_event(self, event: pb.Event) -> None:
            self.own += bool(event.error)
            super()._on_event(event)

    flood = 5 * 4096
    dropped0 = metric(agent, "dpu_agent_session_events_dropped_total")
    with Counting(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "flood")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(256, 1)])
        # A second stream replaces the client's own reader as the session's stream.
        unread = client.stub.Events(pb.SessionRef(session_id=client.session_id), timeout=120)
        keys = [ExpertKey("flood", layer, e).to_proto() for layer in model.moe_layers
                for e in range(model.experts_per_layer)]
        batch = (keys * (4096 // len(keys) + 1))[:4096]
        for _ in range(flood // 4096):  # every key fails: no pool fits an expert
            client.stub.Prefetch(pb.PrefetchRequest(session_id=client.session_id,
                                                    device_id=dev.device_id, keys=batch),
                                 timeout=30)
        deadline = time.monotonic() + 60
        while metric(agent, "dpu_agent_session_events_dropped_total") - dropped0 < \
                flood - 2 * 4096 - client.own:
            assert time.monotonic() < deadline, metric(
                agent, "dpu_agent_session_events_dropped_total")
            time.sleep(0.1)
        # Once the session closes, the stream gets what was kept (at most the capacity, and
        # what the transport had already taken), then ends.
        client.stub.CloseSession(pb.SessionRef(session_id=client.session_id), timeout=10)
        got = [e.error for e in unread]
    dropped = metric(agent, "dpu_agent_session_events_dropped_total") - dropped0
    assert len(got) <= 2 * 4096 and all("background delivery" in e for e in got), len(got)
    assert len(got) + dropped + client.own == flood, (len(got), dropped, client.own)


@pytest.mark.parametrize("kwargs,named", [
    ({"rpc_timeout": -1}, "rpc_timeout: a number of seconds above 0"),
    ({"rpc_timeout": float("inf")}, "rpc_timeout: a number of seconds above 0"),
    ({"connect_timeout": float("nan")}, "connect_timeout: a number of seconds above 0"),
    ({"lease_seconds": -2}, "lease_seconds: an int >= 0"),
])
def test_a_client_refuses_settings_it_cannot_use_before_connecting(kwargs: dict,
                                                                   named: str) -> None:
    """Refused at once, naming the argument (not a connection attempt that waits and then
    blames the agent)."""
    from host_client import AgentClient

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=named):
        AgentClient("127.0.0.1:1", **kwargs)
    assert time.monotonic() - t0 < 1.0
