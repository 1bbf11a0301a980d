"""``AgentClient``: the inference process's handle on the DPU agent.

Shape of the API (register -> acquire -> wait -> release)::

    client = AgentClient("127.0.0.1:50051")
    model = client.load_model("/models/qwen3-30b-a3b")
    gpu = client.register_device(CudaDevice(0), [SlotPoolSpec(model.expert_bytes, 64)])
    handle = client.acquire(gpu, ExpertKey(model.model, 0, 5))   # returns at once
    slot = handle.wait()                     # ExpertSlot: bytes verified in GPU memory
    w = slot.torch("gate_proj")
    client.release(gpu, slot.key)

Acquire, release and prefetch go through the device's data-plane channel in shared memory
(``host_client/requests.py``): no gRPC call, no thread hop. gRPC carries the control plane
(sessions, registration, models, placement, status); the session's upkeep (lease, event
stream, recovery after the agent's death) is ``host_client.session``'s.
"""

from __future__ import annotations

import logging

import numpy as np

from dpu_offload import abi
from dpu_offload.keys import MAX_KEYS_PER_CALL, ExpertKey, key_index_problem
from dpu_offload.v1 import agent_pb2 as pb
from host_client.connection import TlsFiles
from host_client.devices import Device
from host_client.errors import InvalidArgument, refusal, refusal_of
from host_client.handles import AcquireHandle
from host_client.memory import ExpertSlot, SlotPoolSpec
from host_client.placement import PlacementCalls, visit_problem
from host_client.registration import (
    DELIVERIES,
    AttachedDevice,
    SessionContext,
    attach,
    detach,
    link_peers,
)
from host_client.requests import Wake, grant_where
from host_client.slot_checks import LandedCheck

__all__ = ["AgentClient"]

log = logging.getLogger("host_client")


def _nothing() -> None:
    pass


class AgentClient(PlacementCalls):
    """A session with one agent, and what it is for: models, devices, experts, placement.

    Args:
        address: the agent's ``host:port``.
        client_name: shown on the agent's status screens.
        lease_seconds: session lease (0: the agent's default); renewed every third of it.
        connect_timeout: seconds to wait for the agent before AgentUnavailable.
        rpc_timeout: deadline of every unary call, seconds.
        tls: TLS (or mutual TLS) files; None for plaintext.
    """

    def __init__(self, address: str, *, client_name: str = "host-client",
                 lease_seconds: int = 0, connect_timeout: float = 5.0,
                 rpc_timeout: float = 60.0, tls: TlsFiles | None = None) -> None:
        self.prefetches_refused = 0
        """Prefetches posted without waiting that the agent refused."""
        self.visits_refused = 0
        """Entries of :meth:`report_visit` the agent refused."""
        self._models: dict[str, str] = {}
        self._model_index: dict[str, int] = {}
        """Model name -> the index request-ring entries name it by (from LoadModel)."""
        self._manifests: dict[ExpertKey, pb.ExpertManifest] = {}
        self._linked = False
        """Whether link_peers was called (it is redone after a reconnect)."""
        super().__init__(address, client_name=client_name, lease_seconds=lease_seconds,
                         connect_timeout=connect_timeout, rpc_timeout=rpc_timeout, tls=tls)

    # -- models and devices ----------------------------------------------------------------
    def load_model(self, path: str, name: str = "") -> pb.LoadModelResponse:
        """Have the agent catalogue the checkpoint at ``path`` (a directory on the agent's
        machine) under ``name`` (default: the directory's name), and learn every expert's
        tensor layout; reloaded by itself after an agent restart. ``NotFound`` for a path that
        is not a directory, ``InvalidArgument`` naming what the checkpoint lacks
        (docs/LAYOUT.md)."""
        resp = self.stub.LoadModel(pb.LoadModelRequest(path=path, name=name),
                                   timeout=self.rpc_timeout)
        self._models[resp.model] = path  # reloaded if the agent restarts
        self._model_index[resp.model] = resp.model_index
        self.describe([ExpertKey(resp.model, layer, e) for layer in resp.moe_layers
                       for e in range(resp.experts_per_layer)])
        return resp

    def register_device(self, device: Device, pools: list[SlotPoolSpec],
                        ring_capacity: int = 1024, delivery: str = "pull") -> AttachedDevice:
        """Register a device, its slot pools and its rings; starts its consumer.

        ``delivery``: ``"pull"``, the device's consumer copies each chunk from the arena and
        verifies it; ``"engine"``, the agent's DMA-engine process writes the slots (and their
        LANDED words) and this process runs no consumer for the device (no persistent kernel,
        no thread): a waiter checks each landed slot on the device before it reads READY."""
        if not pools:
            raise ValueError("register_device needs at least one slot pool")
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {sorted(DELIVERIES)}, got {delivery!r}")
        attached = self._attach_device(device, list(pools), ring_capacity, delivery=delivery)
        self.devices[attached.device_id] = attached
        return attached

    def deregister_device(self, dev: AttachedDevice) -> None:
        """Give a device back: the agent drops it with its channel, pools and rings, then this
        process stops its consumer and closes its rings (the :class:`Device` can be registered
        again). FailedPrecondition, changing nothing, while a slot of it is held or a delivery
        to it under way, or while a placement or flow rule of this session names it."""
        self.stub.DeregisterDevice(pb.DeviceRef(session_id=self.session_id,
                                                device_id=dev.device_id),
                                   timeout=self.rpc_timeout)
        self.devices.pop(dev.device_id, None)
        detach(dev)

    def _attach_device(self, device: Device, specs: list[SlotPoolSpec], ring_capacity: int,
                       into: AttachedDevice | None = None, delivery: str = "pull"
                       ) -> AttachedDevice:
        return attach(self._context(), device, specs, ring_capacity, into, delivery)

    def _context(self) -> SessionContext:
        return SessionContext(self.stub, self.session_id, self._token, self._bell, self.arena,
                              self.rpc_timeout)

    # -- experts (the data-plane channel) ---------------------------------------------------
    def _index(self, model: str) -> int:
        index = self._model_index.get(model)
        if index is None:
            for m in self.status().models:
                self._model_index[m.model] = m.model_index
            index = self._model_index.get(model)
        if index is None:
            raise refusal(abi.RequestStatus.NOT_FOUND, f"model {model!r} is not loaded")
        return index

    def describe(self, keys: list[ExpertKey]) -> None:
        """Ask the agent for the tensor layouts of ``keys`` not known yet (``load_model`` asks
        for every expert of the model, so the data path never needs gRPC)."""
        todo = [k for k in keys if k not in self._manifests]
        for k in todo:
            problem = key_index_problem(k)
            if problem:
                raise InvalidArgument(problem)
        for i in range(0, len(todo), MAX_KEYS_PER_CALL):
            part = todo[i:i + MAX_KEYS_PER_CALL]
            resp = self.stub.DescribeExperts(pb.DescribeExpertsRequest(
                session_id=self.session_id, keys=[k.to_proto() for k in part]),
                timeout=self.rpc_timeout)
            self._manifests.update(zip(part, resp.manifests, strict=True))

    def manifest(self, key: ExpertKey) -> pb.ExpertManifest:
        """The tensor layout of ``key`` (cached; asked of the agent if not known yet)."""
        if key not in self._manifests:
            self.describe([key])
        return self._manifests[key]

    def model_manifest(self, model: str) -> pb.ExpertManifest | None:
        """One expert's manifest of ``model`` (its experts share their layout), if known."""
        return next((m for k, m in self._manifests.items() if k.model == model), None)

    def _handles(self, dev: AttachedDevice, keys: list[ExpertKey]) -> list[AcquireHandle]:
        if self._down:
            raise self._outage  # the agent is away: no channel would answer this
        # Pinned hits first: an expert this client was granted and that still reads READY
        # there is held through the pin table, with nothing posted.
        hits = dev.channel.pin_many(keys)
        missed = None in hits
        if missed:
            dev.channel.announce()  # the agent's wake-up overlaps the post's making
        epoch, bell = self._epoch, dev.device.doorbell

        def check() -> None:
            dev.device.check()
            dev.channel.check()
            if self._epoch != epoch:
                raise self._outage

        entries: list[tuple[abi.RequestOp, int, ExpertKey] | None] = [None] * len(keys)
        try:  # the misses' layouts known and their requests posted, or no pin kept
            if missed:
                self.describe([k for k, hit in zip(keys, hits, strict=True) if hit is None])
                entries = [None if hit is not None else
                           (abi.RequestOp.ACQUIRE, self._index(k.model), k)
                           for k, hit in zip(keys, hits, strict=True)]
            posted = iter(dev.channel.post([e for e in entries if e is not None])
                          if missed else ())
        except BaseException:
            dev.channel.unpin_many([k for k, hit in zip(keys, hits, strict=True)
                                    if hit is not None])
            raise
        landed = None
        if dev.work is None:  # the DMA engine delivers: no consumer of ours to keep awake
            settle = _nothing
            landed = LandedCheck(dev.device, dev.channel)
        else:
            settle = bell.settle
            for _ in range(hits.count(None)):
                bell.expect()  # the agent may post work: the consumer stays awake until settled
        handles = []
        for key, entry, hit in zip(keys, entries, hits, strict=True):
            if hit is not None:
                handles.append(AcquireHandle.pinned(key, dev.channel, hit.reply,
                                                    dev.slot_for(key, hit.where, self.manifest)))
                continue
            repost = None if landed is None else (
                lambda entry=entry: dev.channel.post([entry])[0])
            handles.append(AcquireHandle(
                key, dev.channel, next(posted),
                lambda reply, key=key: dev.slot_for(key, grant_where(reply), self.manifest),
                check, settle, landed, repost))
        return handles

    def acquire(self, dev: AttachedDevice, key: ExpertKey) -> AcquireHandle:
        """Post an acquire of ``key`` on ``dev`` and return at once; the handle resolves when
        its bytes are verified there (a refusal is raised by ``wait``). Where the DMA engine
        delivers, the check is started on the device with the post, as a batch's are: it is
        waiting there when the agent answers, instead of being launched then."""
        handle = self._handles(dev, [key])[0]
        if not handle.pinned_hit:
            AcquireHandle.check_at_post([handle], [self.manifest(key).blob_bytes],
                                        self.rpc_timeout)
        return handle

    def acquire_batch(self, dev: AttachedDevice, keys: list[ExpertKey], wait: bool = True
                      ) -> list[AcquireHandle]:
        """Acquire several experts (a layer's) with one post. With ``wait``, all or nothing:
        returns once the agent granted every slot (deliveries may still be in flight); if it
        refused any, the granted ones are released and the first refusal is raised. Without,
        at once: the agent grants them in turn while the caller enqueues work behind the first
        ones (``AcquireHandle.enqueue_wait`` waits for its own grant only), each handle's wait
        raises its own refusal, and :meth:`release_granted` gives back the granted ones of a
        batch that will not be used. Each granted expert must be released."""
        handles = self._handles(dev, keys)
        posted = [h for h in handles if not h.pinned_hit]
        if posted:
            # Where the DMA engine delivers, the batch's checks start on the device now, in
            # one launch: each takes its slot from its reply and is checked as its bytes land.
            AcquireHandle.check_at_post(posted, [self.manifest(h.key).blob_bytes
                                                 for h in posted], self.rpc_timeout)
        if not wait:
            return handles
        # The agent answers in order: asleep until the last reply, one wake-up for the batch.
        for h in reversed(handles):
            h.wait_granted(self.rpc_timeout, spin=len(handles) == 1)
        refused = next((h.refusal for h in handles if h.refusal is not None), None)
        if refused is not None:
            self.release_granted(dev, handles)
            raise refused
        return handles

    def release_granted(self, dev: AttachedDevice, handles: list[AcquireHandle]) -> int:
        """Release the experts of one batch's ``handles`` that the agent granted, once it has
        answered each (with one post, as :meth:`release_batch`); returns how many."""
        for h in reversed(handles):
            h.wait_granted(self.rpc_timeout, spin=False)
        granted = [h.key for h in handles if h.refusal is None]
        if granted:
            self.release_batch(dev, granted)
        return len(granted)

    @staticmethod
    def wait_all(handles: list[AcquireHandle], timeout: float | None = 30.0
                 ) -> list[ExpertSlot]:
        """Wait for every handle of a batch (``acquire_batch``) and return their slots in
        order. The last is waited for first: a batch lands in order, so this sleeps through
        it once, where waiting in order wakes once per expert (wait in order instead to
        compute with each expert as it lands). Raises as :meth:`AcquireHandle.wait` does."""
        for h in reversed(handles):
            h.wait(timeout)
        return [h.wait(timeout) for h in handles]

    def link_peers(self) -> dict[int, list[int]]:
        """Let every registered device read the slot pools of each other one it can reach
        (CUDA peer access; every CPU reference device of this process), and tell the agent,
        which may then deliver an expert by copying a verified slot of a peer instead of
        reading the arena. Call it after registering all devices (pools registered later are
        not mapped); redone on its own after an agent restart. A device the DMA engine serves
        reads no peer (the engine copies from the arena), though pull devices may read its
        pools. Returns device id -> the ids of the devices it can read."""
        links = link_peers(self._context(), list(self.devices.values()))
        self._linked = True
        return links

    def _answer(self, dev: AttachedDevice, position: int) -> None:
        """Wait for the reply to ``position``; raise its refusal."""
        refused = refusal_of(dev.channel.wait_reply(position, self.rpc_timeout))
        if refused is not None:
            raise refused

    def prefetch(self, dev: AttachedDevice, keys: list[ExpertKey], wait: bool = True) -> int:
        """Have the agent deliver ``keys`` ahead of use (nothing held); returns how many were
        asked for. With ``wait`` it returns once the agent answered (the first refusal is
        raised); without, at once: a refusal (no slot free, say) is only counted in
        ``prefetches_refused``, as a prefetch is a hint."""
        entries = [(abi.RequestOp.PREFETCH, self._index(k.model), k) for k in keys]
        if not wait:
            dev.channel.post(entries, on_refusal=self._prefetch_refused, wake=Wake.RING)
            dev.device.doorbell.ring()
            return len(keys)
        positions = dev.channel.post(entries)
        dev.device.doorbell.ring()
        for p in positions:
            self._answer(dev, p)
        return len(keys)

    def _prefetch_refused(self, reply: np.void) -> None:
        self.prefetches_refused += 1

    def report_visit(self, dev: AttachedDevice, model: str, layer: int,
                     tokens: dict[int, int], prefetch: int = 0) -> None:
        """One MoE layer's routing, through ``dev``'s data-plane channel (no gRPC call; it
        returns at once): ``tokens[e]`` tokens chose expert ``e``. The agent folds it into its
        routing statistics in order with this device's acquires, at its next wake (it is not
        woken for it: ``Wake.LAZY``) or, with ``prefetch`` k > 0, at once, prefetching into
        ``dev`` the k experts it expects the next MoE layer to select. A hint:
        a refusal is only counted in ``visits_refused`` (:meth:`report_routing` is the gRPC
        form, for several visits at once or from outside a device's path)."""
        problem = visit_problem(layer, tokens)
        if problem:
            raise ValueError(problem)
        if not 0 <= prefetch <= abi.MAX_ROUTE_PREFETCH:
            raise ValueError(f"prefetch {prefetch}: expected [0, {abi.MAX_ROUTE_PREFETCH}]")
        dev.channel.post_visit(self._index(model), layer, tokens, prefetch, self._visit_refused)
        if prefetch:
            dev.device.doorbell.ring()

    def _visit_refused(self, reply: np.void) -> None:
        self.visits_refused += 1

    def release(self, dev: AttachedDevice, key: ExpertKey, wait: bool = True) -> None:
        """Drop one reference on ``key``'s slot. With ``wait=False`` the call returns once the
        request is posted (the agent serves a channel's requests in order, so a later acquire
        sees the slot freed); a refusal is then logged, not raised. A pinned hit's reference, and
        a grant held by a pin (a DMA-engine device's), is dropped in the pin table, nothing
        posted. While the agent is away
        (its session and references went with it) ``wait=True`` raises AgentUnavailable."""
        if self._down:
            if wait:
                raise self._outage
            return
        if not wait:
            self.release_batch(dev, [key])
        elif not dev.channel.unpin(key):
            entry = [(abi.RequestOp.RELEASE, self._index(key.model), key)]
            self._answer(dev, dev.channel.post(entry)[0])

    def release_batch(self, dev: AttachedDevice, keys: list[ExpertKey]) -> None:
        """Drop one reference on each of ``keys`` with one post (a layer's experts), returning
        at once; refusals are logged (as ``release(wait=False)``). References held by pins
        are dropped in the pin table, the agent left asleep (a next acquire that misses
        announces itself, ``_handles``)."""

        if self._down:
            return  # the agent is away: the references went with its session

        def refused(reply: np.void) -> None:
            log.warning("release on device %d failed: %s", dev.device_id, refusal_of(reply))

        posted = [k for k, unpinned in zip(keys, dev.channel.unpin_many(keys), strict=True)
                  if not unpinned]
        if posted:
            dev.channel.post([(abi.RequestOp.RELEASE, self._index(k.model), k) for k in posted],
                             on_refusal=refused, wake=Wake.RING)

    def status(self) -> pb.StatusResponse:
        """The agent's state: this session (every session for an administrator's
        certificate), models, arena and cache counters, transfers in flight."""
        return self.stub.GetStatus(pb.StatusRequest(), timeout=self.rpc_timeout)

    # -- the session's hooks -----------------------------------------------------------------
    def _restore(self) -> None:
        """Reload the models this client loaded and re-register every device with fresh rings
        and pools."""
        for name, path in list(self._models.items()):
            self.stub.LoadModel(pb.LoadModelRequest(path=path, name=name),
                                timeout=self.rpc_timeout)
        old, self.devices = list(self.devices.values()), {}
        for dev in old:
            detach(dev)
            self._attach_device(dev.device, dev.specs, dev.ring_capacity, into=dev,
                                delivery=dev.delivery)
            self.devices[dev.device_id] = dev
        if self._linked:
            self.link_peers()

    def _release(self) -> None:
        for dev in self.devices.values():
            detach(dev)

    def __enter__(self) -> AgentClient:
        return self
