"""The v1 gRPC service: request validation, and the calls of the core (translated to and from
protobuf by :mod:`dpu_agent.service.translate`).

Every refusal carries a specific status code and a message naming what was wrong; the core
(:mod:`dpu_agent.orchestrator`) guarantees that a refused request changed nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from dpu_agent import __version__
from dpu_agent.dataplane.steering import apply_session_flows
from dpu_agent.errors import AgentError, invalid
from dpu_agent.identity import current_caller
from dpu_agent.orchestrator import Orchestrator
from dpu_agent.regions import RegionSpec
from dpu_agent.registry import (
    ARENA_REGION_ID,
)
from dpu_agent.service import translate
from dpu_agent.weights.cache import WouldBlock
from dpu_offload import abi
from dpu_offload.flows import Action, FlowRule, TrafficClass
from dpu_offload.keys import MAX_STEPS_PER_REPORT
from dpu_offload.v1 import agent_pb2 as pb
from dpu_offload.v1 import agent_pb2_grpc as pb_grpc

T = TypeVar("T")

class DpuAgentServicer(pb_grpc.DpuAgentServicer):
    """Implements ``dpu_offload.v1.DpuAgent`` over an :class:`Orchestrator`."""

    def __init__(self, core: Orchestrator) -> None:
        self.core = core
        self._active: dict[str, int] = {}

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[..., T],
                   *args: Any, blocking: bool = False, session_id: str = "") -> T:
        if self.core.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the agent is stopping")
        limit = self.core.config.sessions.max_concurrent_rpcs
        if session_id:
            if self._active.get(session_id, 0) >= limit:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"session has {limit} calls in flight (sessions."
                                    "max_concurrent_rpcs)")
            self._active[session_id] = self._active.get(session_id, 0) + 1
        try:
            if blocking:
                return await asyncio.to_thread(fn, *args)
            return fn(*args)
        except AgentError as exc:
            await context.abort(translate.CODES[exc.kind], translate.shown(exc.message))
            raise  # unreachable: abort raises
        finally:
            if session_id:
                self._active[session_id] -= 1
                if not self._active[session_id]:
                    del self._active[session_id]

    async def CreateSession(self, request: pb.CreateSessionRequest,
                            context: grpc.aio.ServicerContext) -> pb.CreateSessionResponse:
        s, token = await self._run(context, self.core.create_session, request.client_name,
                                   request.lease_seconds)
        arena = self.core.arena
        return pb.CreateSessionResponse(
            session_id=s.session_id, session_token=token, lease_seconds=int(s.lease_seconds),
            arena=pb.ArenaInfo(shm_name=arena.name, size_bytes=arena.size,
                               region_id=ARENA_REGION_ID),
            activations_port=self.core.activations.port if self.core.activations else 0,
            bell_shm_name=self.core.plane.bell.name, shm_gid=self.core.shm_group)

    async def KeepAlive(self, request: pb.SessionRef, context: grpc.aio.ServicerContext
                        ) -> pb.Empty:
        await self._run(context, self.core.session, request.session_id)
        return pb.Empty()

    async def CloseSession(self, request: pb.SessionRef, context: grpc.aio.ServicerContext
                           ) -> pb.Empty:
        def call() -> None:
            self.core.session(request.session_id)  # the caller's own (close_session is also
            self.core.close_session(request.session_id)  # the reaper's, which has no caller)

        # In a thread: detaching the session's devices from the DMA engine waits on it.
        await self._run(context, call, blocking=True)
        return pb.Empty()

    async def RegisterDevice(self, request: pb.RegisterDeviceRequest,
                             context: grpc.aio.ServicerContext) -> pb.RegisterDeviceResponse:
        def call() -> pb.RegisterDeviceResponse:
            s = self.core.session(request.session_id)
            kind = translate.DEVICE_KINDS.get(request.kind)
            if kind is None:
                raise invalid(f"device kind {request.kind} is not CUDA or CPU_REFERENCE")
            delivery = translate.DELIVERIES.get(request.delivery)
            if delivery is None:
                raise invalid(f"delivery {request.delivery} is not DEVICE_PULL or DMA_ENGINE")
            dev = self.core.registrations.register_device(s, kind, request.ordinal,
                                                          request.name, delivery)
            assert dev.channel is not None
            return pb.RegisterDeviceResponse(device_id=dev.device_id, channel=pb.ChannelInfo(
                shm_name=dev.channel.name, size_bytes=dev.channel.size,
                capacity=dev.channel.view.capacity))
        return await self._run(context, call, blocking=True, session_id=request.session_id)

    async def RegisterRegion(self, request: pb.RegisterRegionRequest,
                             context: grpc.aio.ServicerContext) -> pb.RegisterRegionResponse:
        def call() -> int:
            session = self.core.session(request.session_id)
            kind = translate.REGION_KINDS.get(request.kind)
            if kind is None:
                raise invalid(f"region kind {request.kind} is not supported by this agent")
            if len(request.home_layers) > abi.MAX_CHANNEL_SLOTS:  # bounded before it is copied
                raise invalid(f"home_layers: {len(request.home_layers)} layers, more than a "
                              f"pool's {abi.MAX_CHANNEL_SLOTS} slots could be cut into")
            return self.core.registrations.register_region(session, RegionSpec(
                request.device_id, kind, request.size_bytes, request.shm_name,
                bytes(request.cuda_ipc_handle), request.slot_bytes, request.slot_count,
                tuple(request.home_layers)))
        return pb.RegisterRegionResponse(region_id=await self._run(
            context, call, blocking=True, session_id=request.session_id))

    async def LinkPeers(self, request: pb.LinkPeersRequest, context: grpc.aio.ServicerContext
                        ) -> pb.Empty:
        def call() -> None:
            self.core.registrations.link_peers(self.core.session(request.session_id),
                                               request.device_id, list(request.sources))
        await self._run(context, call)
        return pb.Empty()

    async def ServeActivations(self, request: pb.ServeActivationsRequest,
                               context: grpc.aio.ServicerContext) -> pb.Empty:
        def call() -> None:
            self.core.serve_activations(self.core.session(request.session_id),
                                        request.device_id, request.serve)
        await self._run(context, call, blocking=True, session_id=request.session_id)
        return pb.Empty()

    async def DeregisterDevice(self, request: pb.DeviceRef, context: grpc.aio.ServicerContext
                               ) -> pb.Empty:
        def call() -> None:
            self.core.registrations.deregister_device(
                self.core.session(request.session_id), request.device_id)
        await self._run(context, call, blocking=True, session_id=request.session_id)
        return pb.Empty()

    async def DeregisterRegion(self, request: pb.RegionRef, context: grpc.aio.ServicerContext
                               ) -> pb.Empty:
        def call() -> None:
            self.core.registrations.deregister_region(
                self.core.session(request.session_id), request.region_id)
        await self._run(context, call, blocking=True, session_id=request.session_id)
        return pb.Empty()

    async def LoadModel(self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext
                        ) -> pb.LoadModelResponse:
        cat = await self._run(context, self.core.load_model, request.path, request.name,
                              blocking=True)
        return pb.LoadModelResponse(
            model=cat.name, architecture=cat.layout.architecture,
            moe_layers=list(cat.layout.moe_layers),
            experts_per_layer=cat.layout.experts_per_layer, expert_bytes=cat.expert_bytes,
            total_expert_bytes=cat.total_expert_bytes,
            model_index=self.core.model_index(cat.name))

    async def DescribeExperts(self, request: pb.DescribeExpertsRequest,
                              context: grpc.aio.ServicerContext) -> pb.DescribeExpertsResponse:
        def call() -> pb.DescribeExpertsResponse:
            self.core.session(request.session_id)
            translate.bounded(request.keys)
            chunk = self.core.config.transfer.chunk_bytes
            return pb.DescribeExpertsResponse(manifests=[
                translate.manifest(self.core.expert(translate.key(k, "keys[]")), chunk)
                for k in request.keys])
        return await self._run(context, call)

    def _acquire(self, session_id: str, device_id: int, key: pb.ExpertKey, wait: bool = True
                 ) -> pb.AcquireResponse:
        s = self.core.session(session_id)
        grant = self.core.grants.acquire(s, device_id, translate.key(key), wait)
        return pb.AcquireResponse(
            transfer_id=grant.transfer_id, region_id=grant.region_id,
            slot_index=grant.slot_index, slot_offset=grant.slot_offset,
            state=pb.SLOT_STATE_READY if grant.ready else pb.SLOT_STATE_FILLING,
            state_index=grant.state_index, generation=grant.generation,
            manifest=translate.manifest(grant.entry, self.core.config.transfer.chunk_bytes,
                                        grant.checksums))

    def _acquire_all(self, session_id: str, device_id: int, keys: list[pb.ExpertKey],
                     done: list[pb.AcquireResponse], wait: bool) -> None:
        """Acquire ``keys[len(done):]`` into ``done``. ``wait=False`` stops at the first key
        that needs an arena fill (WouldBlock) so the caller can go on off the event loop. Any
        other refusal releases what this request acquired and is raised."""
        try:
            for k in keys[len(done):]:
                done.append(self._acquire(session_id, device_id, k, wait))
        except WouldBlock:
            raise
        except BaseException:
            self._give_back(session_id, device_id, keys[:len(done)])
            raise

    def _give_back(self, session_id: str, device_id: int, keys: list[pb.ExpertKey]) -> None:
        """Release one reference on each of ``keys`` (grants nobody will receive); a session
        already gone released them itself."""
        with contextlib.suppress(AgentError):
            s = self.core.session(session_id)
            for k in keys:
                self.core.release(s, device_id, translate.key(k))

    async def _acquire_keys(self, context: grpc.aio.ServicerContext, session_id: str,
                            device_id: int, keys: list[pb.ExpertKey]
                            ) -> list[pb.AcquireResponse]:
        """Grants for ``keys`` in order. Hits (slot or arena resident) are served on the event
        loop, which spares a worker-thread round trip per call; from the first key that needs
        an arena fill on, the rest run on a worker thread."""
        done: list[pb.AcquireResponse] = []
        try:
            await self._run(context, self._acquire_all, session_id, device_id, keys, done,
                            False, session_id=session_id)
        except WouldBlock:
            slow = asyncio.ensure_future(self._run(
                context, self._acquire_all, session_id, device_id, keys, done, True,
                blocking=True, session_id=session_id))
            try:
                await asyncio.shield(slow)
            except asyncio.CancelledError:
                # The caller is gone (deadline or cancel) while a worker thread fills: let it
                # finish, then give back what this request took, or the references would stay
                # until the session's lease ran out.
                with contextlib.suppress(Exception):
                    await slow
                self._give_back(session_id, device_id, keys[:len(done)])
                raise
        return done

    async def Acquire(self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext
                      ) -> pb.AcquireResponse:
        return (await self._acquire_keys(context, request.session_id, request.device_id,
                                         [request.key]))[0]

    async def AcquireBatch(self, request: pb.AcquireBatchRequest,
                           context: grpc.aio.ServicerContext) -> pb.AcquireBatchResponse:
        def check() -> None:  # every key names a loaded expert, before any is acquired
            self.core.session(request.session_id)
            translate.bounded(request.keys)
            for k in request.keys:
                self.core.expert(translate.key(k, "keys[]"))

        await self._run(context, check)
        return pb.AcquireBatchResponse(slots=await self._acquire_keys(
            context, request.session_id, request.device_id, list(request.keys)))

    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext
                       ) -> pb.PrefetchResponse:
        def call() -> pb.PrefetchResponse:
            self.core.session(request.session_id)
            translate.bounded(request.keys)
            keys = [translate.key(k, "keys[]") for k in request.keys]
            n = self.core.prefetch(self.core.session(request.session_id), request.device_id,
                                   keys)
            return pb.PrefetchResponse(scheduled=n)
        return await self._run(context, call, blocking=True, session_id=request.session_id)

    async def ApplyPlacement(self, request: pb.ApplyPlacementRequest,
                             context: grpc.aio.ServicerContext) -> pb.ApplyPlacementResponse:
        def call() -> pb.ApplyPlacementResponse:
            session = self.core.session(request.session_id)
            assignment = [[list(devs.device_ids) for devs in layer.experts]
                          for layer in request.layers]
            state = self.core.placements.apply(session, request.model, assignment)
            return pb.ApplyPlacementResponse(
                placement_id=state.placement_id, copies_to_add=state.total,
                copies_to_drop=sum(len(v) for v in state.retire.values()) + state.dropped)
        return await self._run(context, call, blocking=True, session_id=request.session_id)

    async def Rebalance(self, request: pb.RebalanceRequest, context: grpc.aio.ServicerContext
                        ) -> pb.RebalanceResponse:
        def call() -> pb.RebalanceResponse:
            session = self.core.session(request.session_id)
            state, ratio, moved = self.core.placements.rebalance(session, request.model,
                                                                 request.replicas)
            return pb.RebalanceResponse(
                placement_id=state.placement_id, max_load_ratio=ratio, bytes_moved=moved,
                copies_to_add=state.total,
                copies_to_drop=sum(len(v) for v in state.retire.values()) + state.dropped)
        return await self._run(context, call, blocking=True, session_id=request.session_id)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
                      ) -> pb.Empty:
        def call() -> None:
            self.core.release(self.core.session(request.session_id), request.device_id,
                              translate.key(request.key))
        await self._run(context, call)
        return pb.Empty()

    async def ReportRouting(self, request: pb.ReportRoutingRequest,
                            context: grpc.aio.ServicerContext) -> pb.Empty:
        def call() -> None:
            self.core.session(request.session_id)
            if len(request.steps) > MAX_STEPS_PER_REPORT:
                raise invalid(f"{len(request.steps)} steps in one call; at most "
                              f"{MAX_STEPS_PER_REPORT}")
            steps = []
            for i, step in enumerate(request.steps):
                if len(step.experts) != len(step.tokens):
                    raise invalid(f"steps[{i}]: {len(step.experts)} experts but "
                                  f"{len(step.tokens)} token counts")
                steps.append((step.layer, dict(zip(step.experts, step.tokens, strict=True))))
            prefetch = None
            if request.prefetch_top_k:
                prefetch = (self.core.session(request.session_id), request.prefetch_device_id,
                            request.prefetch_top_k)
            self.core.report_routing(request.model, steps, prefetch)
        await self._run(context, call, blocking=True, session_id=request.session_id)
        return pb.Empty()

    async def Events(self, request: pb.SessionRef, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.Event]:
        session = await self._run(context, self.core.session, request.session_id)
        queue = session.events.attach(asyncio.get_running_loop())
        try:
            while True:
                event = await queue.get()
                if event is None:
                    return
                yield translate.event(event)
        finally:
            session.events.detach(queue)

    async def ApplyFlows(self, request: pb.ApplyFlowsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ApplyFlowsResponse:
        def call() -> pb.ApplyFlowsResponse:
            session = self.core.session(request.session_id)
            rules = []
            for i, m in enumerate(request.add):
                try:
                    traffic, action = TrafficClass(m.traffic), Action(m.action)
                except ValueError as exc:
                    raise invalid(f"add[{i}]: {exc}") from exc
                for q in m.queues:
                    self.core.device(session, q)
                rules.append(FlowRule(m.rule_id, traffic, action, m.model, m.layer_min,
                                      m.layer_max, m.expert, m.source, tuple(m.queues),
                                      m.priority, origin=m.origin))
            version, added = apply_session_flows(self.core.flows, session.session_id, rules,
                                                 list(request.delete))
            self.core.steering_changed()
            return pb.ApplyFlowsResponse(version=version, added=added)
        return await self._run(context, call, session_id=request.session_id)

    async def ListFlows(self, request: pb.ListFlowsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListFlowsResponse:
        flows = self.core.flows
        counted = await asyncio.to_thread(self.core.steering_counters)
        return pb.ListFlowsResponse(
            version=flows.version, lookups=counted.lookups, misses=counted.misses,
            rules=[pb.FlowRule(
                rule_id=r.rule_id, traffic=r.traffic.value, action=r.action.value,
                model=r.model, layer_min=r.layer_min, layer_max=r.layer_max, expert=r.expert,
                source=r.source, queues=list(r.queues), priority=r.priority, origin=r.origin,
                packets=counted.rules.get(r.rule_id, (0, 0, 0))[0],
                bytes=counted.rules.get(r.rule_id, (0, 0, 0))[1])
                for r in flows.rules()])

    async def GetStatus(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
                        ) -> pb.StatusResponse:
        core = self.core
        who = current_caller()
        everyone = list(core.sessions.values())
        admin = bool(who.name) and who.name in core.config.server.admin_names
        sessions = [s for s in everyone if admin or (s.binding is not None
                                                     and s.binding.admits(who))]
        return pb.StatusResponse(
            other_sessions=len(everyone) - len(sessions),
            version=__version__, uptime_seconds=time.time() - core.started,
            sessions=[pb.SessionStatus(
                session_id=s.session_id, client_name=s.client_name, devices=len(s.devices),
                regions=sum(len(d.regions) for d in s.devices.values()),
                slots_held=sum(p.held_count() for d in s.devices.values()
                               for p in d.pools.values()),
                slots_ready=sum(p.ready_count() for d in s.devices.values()
                                for p in d.pools.values()),
                lease_remaining_seconds=s.lease_remaining) for s in sessions],
            models=[pb.ModelStatus(model=m.name, architecture=m.layout.architecture,
                                   experts=len(m.experts), model_index=core.model_index(m.name),
                                   degraded=core.cache.degraded.get(m.name, ""),
                                   manifest=m.manifest is not None)
                    for m in list(core.models.values())],
            arena_bytes=core.arena.size, arena_used_bytes=core.arena.used_bytes,
            experts_cached=core.cache.resident, cache_hits=core.cache.stats.hits,
            cache_misses=core.cache.stats.misses,
            transfers_in_flight=core.plane.deliveries.tracker.in_flight,
            arena_pins=core.cache.pinned())
