"""The agent process: gRPC server (with the standard health and reflection services), the
orchestrator, the lease reaper, and an orderly stop."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha
from grpc_reflection.v1alpha._async import ReflectionServicer
from prometheus_client import CollectorRegistry, start_http_server

from dpu_agent.cluster.agent import ClusterAgent
from dpu_agent.cluster.settings import ClusterSettings
from dpu_agent.cluster.store import ClusterUnavailable
from dpu_agent.config import KEYS, LIVE_SETTINGS, AgentConfig
from dpu_agent.dataplane.nic import ActivationNic
from dpu_agent.dataplane.steering import build_snapshot
from dpu_agent.orchestrator import Orchestrator
from dpu_agent.service.interceptors import (
    CallerInterceptor,
    GuardInterceptor,
    MetricsInterceptor,
)
from dpu_agent.service.lifecycle import Notifier
from dpu_agent.service.metrics import AgentCollector
from dpu_agent.service.servicer import DpuAgentServicer
from dpu_offload.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger("dpu_agent")
SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["DpuAgent"].full_name


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
"""Server reflection v1: its messages are v1alpha's under another package name (same fields,
same numbers), so grpcio-reflection's servicer serves it with the v1alpha message classes.
grpcio-reflection registers v1alpha only; clients (grpcurl, Postman) try v1 first."""


def enable_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Server reflection, v1alpha and v1, listing ``service_names`` (v1 itself is not listed:
    its descriptors are not in this process, so a client could not describe it)."""
    servicer = ReflectionServicer(service_names)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_v1alpha.ServerReflectionRequest.FromString,
        response_serializer=reflection_v1alpha.ServerReflectionResponse.SerializeToString)
    for name in (reflection.SERVICE_NAME, REFLECTION_V1):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": info}),))


class AgentServer:
    """One running agent: call :meth:`start`, then :meth:`wait` or :meth:`stop`."""

    def __init__(self, config: AgentConfig, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier({})
        self._watchdog: asyncio.Task[None] | None = None
        self.core: Orchestrator | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_port = 0
        self._metrics_server = None
        self.nic: ActivationNic | None = None
        self.cluster: ClusterAgent | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        """Bind every listener and report SERVING; raises (nothing left running) on failure."""
        self.core = Orchestrator(self.config)  # restores persisted state
        opts = [("grpc.max_receive_message_length", self.config.server.max_message_bytes),
                ("grpc.max_send_message_length", self.config.server.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        self.registry = CollectorRegistry()
        self.registry.register(AgentCollector(self.core))
        server = grpc.aio.server(options=opts,
                                 interceptors=[MetricsInterceptor(self.registry),
                                               GuardInterceptor(), CallerInterceptor()])
        agent_pb2_grpc.add_DpuAgentServicer_to_server(DpuAgentServicer(self.core), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection(server, (SERVICE_NAME,
                                   health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                   reflection.SERVICE_NAME))
        try:
            if self.config.server.tls_cert:
                creds = grpc.ssl_server_credentials(
                    [(Path(self.config.server.tls_key).read_bytes(),
                      Path(self.config.server.tls_cert).read_bytes())],
                    root_certificates=(Path(self.config.server.tls_client_ca).read_bytes()
                                       if self.config.server.tls_client_ca else None),
                    require_client_auth=bool(self.config.server.tls_client_ca))
                self.port = server.add_secure_port(self.config.server.listen_address, creds)
            else:
                self.port = server.add_insecure_port(self.config.server.listen_address)
        except RuntimeError as exc:
            self.core.shutdown()
            raise OSError(f"server.listen_address {self.config.server.listen_address}: cannot bind "
                          f"({exc})") from exc
        await server.start()
        self.server = server
        if self.config.metrics.listen_address:
            try:
                self._start_metrics()
            except OSError:
                await server.stop(None)
                self.core.shutdown()
                raise
        activations = self.config.activations
        if activations.listen_address:
            core = self.core
            try:
                self.nic = await asyncio.to_thread(
                    ActivationNic, activations, lambda v: build_snapshot(core, v))
            except OSError as exc:
                await server.stop(None)
                self.core.shutdown()
                raise OSError(f"activations.listen_address {activations.listen_address}: "
                              f"cannot start the NIC stand-in ({exc})") from exc
            self.core.activations = self.nic
        cluster = self.config.cluster.settings
        if cluster is not None:
            await self._join_cluster(cluster)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap())
        if self.notifier.watchdog_seconds:
            self._watchdog = asyncio.create_task(self._watch(self.notifier.watchdog_seconds))
        log.info("agent serving on %s (port %d)", self.config.server.listen_address, self.port)
        self.notifier.ready(self.status_line())

    async def _join_cluster(self, settings: ClusterSettings) -> None:
        """READY only once joined: etcd is retried with backoff up to the join timeout."""
        assert self.core is not None and self.server is not None
        host = self.config.server.listen_address.rsplit(":", 1)[0]
        activations = (f"{host}:{self.nic.port}" if self.nic is not None else "")
        self.cluster = ClusterAgent(self.core, settings, f"{host}:{self.port}", activations)
        try:
            await asyncio.to_thread(self.cluster.start)
        except (ClusterUnavailable, OSError) as exc:
            self.cluster = None
            await self.server.stop(None)
            if self.nic is not None:
                self.nic.close()
            self.core.shutdown()
            raise OSError(f"cluster: cannot join ({exc})") from exc
        self.core.cluster = self.cluster
        self.core.steering_changed()  # routes to the experts other agents hold

    def status_line(self) -> str:
        core = self.core
        assert core is not None
        return (f"serving on port {self.port}: {len(core.sessions)} sessions, "
                f"{len(core.models)} models, "
                f"{core.plane.deliveries.tracker.in_flight} transfers in flight")

    def alive(self) -> bool:
        """Liveness: the data-plane loop thread runs and looped recently (it naps at most
        0.5 ms when idle). The caller being scheduled proves the event loop answers."""
        core = self.core
        return core is not None and core.plane.loop.alive() and \
            time.monotonic() - core.plane.loop.heartbeat < 2.0

    async def _watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.alive():
                self.notifier.watchdog()
                self.notifier.status(self.status_line())
            else:
                log.error("liveness check failed: the data-plane loop stalled; withholding "
                          "the watchdog ping")

    def reload(self, new: AgentConfig) -> list[str]:
        """Apply the settings that can change live; returns 'key: old -> new' for each."""
        assert self.core is not None
        differ = [(section, key) for section, key in KEYS
                  if new.value(section, key) != self.config.value(section, key)]
        changes = [k for k in differ if k in LIVE_SETTINGS]
        applied = [f"{s}.{k}: {self.config.value(s, k)} -> {new.value(s, k)}"
                   for s, k in changes]
        by_section: dict[str, dict[str, Any]] = {}
        for s, k in changes:
            by_section.setdefault(s, {})[k] = new.value(s, k)
        self.config = replace(self.config, **{
            s: replace(getattr(self.config, s), **given) for s, given in by_section.items()})
        self.core.config = self.config
        self.core.scheduler.link_concurrency = self.config.transfer.link_concurrency
        ignored = [f"{s}.{k}" for s, k in differ if (s, k) not in LIVE_SETTINGS]
        if ignored:
            log.warning("SIGHUP: %s need a restart to change", ", ".join(ignored))
        log.info("SIGHUP: applied %s", "; ".join(applied) or "nothing (no live setting changed)")
        return applied

    def _start_metrics(self) -> None:
        assert self.core is not None
        address = self.config.metrics.listen_address
        host, port = address.rsplit(":", 1)
        try:
            self._metrics_server, _ = start_http_server(int(port), host.strip("[]"),
                                                        registry=self.registry)
        except OSError as exc:
            raise OSError(f"metrics.listen_address {address}: cannot bind "
                          f"({exc.strerror})") from exc
        self.metrics_port = self._metrics_server.server_port

    async def _reap(self) -> None:
        assert self.core is not None
        interval = self.config.placement.rebalance_interval_seconds
        loop = asyncio.get_running_loop()
        next_rebalance = loop.time() + interval
        while True:
            await asyncio.sleep(0.25)
            if interval and loop.time() >= next_rebalance:
                next_rebalance = loop.time() + interval
                await asyncio.to_thread(self.core.placements.rebalance_all)
            try:
                for sid in await asyncio.to_thread(self.core.expire_sessions):
                    log.warning("session %s lease expired; its regions and slots are "
                                "reclaimed", sid)
            except Exception:
                log.exception("lease reaper: reclaiming failed")

    async def stop(self, grace: float | None = None) -> None:
        """Stop taking work, let transfers in flight finish within ``grace`` seconds (the
        config's ``server.drain_grace_seconds`` by default), cancel the rest, close."""
        if self.server is None:
            return
        assert self.core is not None
        grace = self.config.server.drain_grace_seconds if grace is None else grace
        self.notifier.stopping(f"draining {self.core.plane.deliveries.tracker.in_flight} transfers")
        self.core.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._reaper is not None:
            self._reaper.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.core.plane.deliveries.tracker.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        try:
            cancelled = self.core.plane.deliveries.tracker.cancel(lambda t: True)
            if cancelled:
                log.warning("stop: cancelled %d transfers still in flight after %.1f s",
                            len(cancelled), grace)
            self.core.persist()
            for s in list(self.core.sessions.values()):
                s.events.close()
            await self.server.stop(grace)
            if self.nic is not None:
                self.nic.close()
            if self.cluster is not None:
                self.cluster.close()
            self.core.shutdown()
        finally:
            # Whatever failed above was logged by the task; the process must still exit.
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
            self.server = None
            self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

