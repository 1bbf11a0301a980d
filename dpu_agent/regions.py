"""A session's devices, regions and rings: registration and its checks. Each region is memory
of the session's own (its shared-memory name bound to the session's token, unknown to the agent
by any other name or handle), each slot pool gets its range of the device channel's slot-state
table, and a DMA-engine device has its pools handed to the engine and no rings of its own.
The core speaks the domain types here; the service layer translates RegisterDevice and
RegisterRegion into them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from dpu_agent.dataplane.channels import DeviceChannel
from dpu_agent.dataplane.engine import EngineError
from dpu_agent.dataplane.queues import DeviceQueue, check_ring
from dpu_agent.dataplane.steering import owned_by
from dpu_agent.errors import AgentError, ErrorKind, invalid, not_found, precondition
from dpu_agent.registry import Delivery, Device, DeviceKind, RegionKind, Session
from dpu_agent.slots import SlotPool
from dpu_agent.weights.policies import EvictionPolicy
from dpu_offload import abi
from dpu_offload.abi import SlotState
from dpu_offload.blob import pool_problem
from dpu_offload.ring import RingError
from dpu_offload.shm import SharedBufferError, bound_to

if TYPE_CHECKING:
    from dpu_agent.dataplane.plane import DataPlane
    from dpu_agent.planning.apply import PlacementExecutor
    from dpu_offload.flows import FlowTable

IPC_HANDLE_BYTES = 64
"""``cudaIpcMemHandle_t``."""
_RING_KINDS = {RegionKind.WORK_RING: abi.RingKind.WORK,
               RegionKind.COMPLETION_RING: abi.RingKind.COMPLETION,
               RegionKind.RX_RING: abi.RingKind.RX_PACKET,
               RegionKind.TX_RING: abi.RingKind.TX_PACKET}


@dataclass(frozen=True)
class RegionSpec:
    """A region a client registers on one of its devices.

    Attributes:
        device_id: the device it belongs to.
        kind: what it is.
        size_bytes: its length in bytes.
        shm_name: the shared-memory name it is exported by (rings; CPU reference pools).
        ipc_handle: the CUDA IPC handle of a pool in GPU memory (64 bytes, or empty).
        slot_bytes, slot_count: a slot pool's slot size (bytes, a multiple of the blob
            alignment) and count.
        home_layers: a slot pool's homes (``SlotPool.home_layers``; empty: none).
    """

    device_id: int
    kind: RegionKind
    size_bytes: int = 0
    shm_name: str = ""
    ipc_handle: bytes = b""
    slot_bytes: int = 0
    slot_count: int = 0
    home_layers: tuple[int, ...] = ()


class RegistrationCore(Protocol):
    """What registration needs of the agent's core (the Orchestrator)."""

    plane: DataPlane

    def device(self, session: Session, device_id: int) -> Device: ...
    def exports(self) -> set[str | bytes]: ...
    placements: PlacementExecutor
    flows: FlowTable

    def devices_changed(self) -> None: ...
    def device_removed(self, dev: Device) -> None: ...
    def slot_policy(self) -> EvictionPolicy:
        """A new slot pool's eviction policy (the configured one)."""


class Registrations:
    """Registers devices and their regions for sessions.

    Args:
        core: the agent's core.
        max_devices: devices one session may register (``sessions.max_devices``).
    """

    def __init__(self, core: RegistrationCore, max_devices: int) -> None:
        self.core = core
        self.max_devices = max_devices
        self._device_ids = itertools.count()
        self._claims_lock = threading.Lock()
        self._claimed: dict[str, set[str | bytes]] = {}
        """Session id -> names and handles its registration under way has checked and not yet
        registered (one at a time per session: ``Session.registering``); another session's
        region is refused them as if registered."""

    def register_device(self, session: Session, kind: DeviceKind, ordinal: int, name: str,
                        delivery: Delivery) -> Device:
        """A new device of the session with its data-plane channel (and, for a DMA-engine
        device, its rings to the engine). The engine is waited for outside ``session.lock``:
        the data-plane loop serves the session's other devices meanwhile."""
        with session.registering:
            with session.lock:
                if len(session.devices) >= self.max_devices:
                    raise AgentError(ErrorKind.RESOURCE_EXHAUSTED,
                                     f"session has {len(session.devices)} devices, the most "
                                     "one may register (sessions.max_devices)")
                for dev in session.devices.values():
                    if dev.kind == kind and dev.ordinal == ordinal:
                        raise AgentError(ErrorKind.ALREADY_EXISTS,
                                         f"device ordinal {ordinal} is already registered as "
                                         f"device {dev.device_id}")
            dev = Device(next(self._device_ids), kind, ordinal, name[:128], delivery=delivery)
            dev.channel = DeviceChannel((session.session_id, dev.device_id))
            if delivery == Delivery.DMA_ENGINE:
                try:
                    dev.queue = self.core.plane.engine.attach(dev)
                except EngineError as exc:
                    dev.channel.close()
                    raise AgentError(ErrorKind.UNAVAILABLE,
                                     f"the DMA engine cannot take device: {exc}") from exc
            with session.lock:
                committed = not session.closed
                if committed:
                    session.devices[dev.device_id] = dev
            if not committed:
                self.core.device_removed(dev)
                raise not_found(f"session {session.session_id} closed while device {ordinal} "
                                "was being registered")
        self.core.devices_changed()
        return dev

    def deregister_device(self, session: Session, device_id: int) -> None:
        """Remove a device of the session with its channel, pools and rings (how a client
        undoes a registration it could not finish, or gives a device back). FAILED_PRECONDITION,
        changing nothing, while a slot of it is held, filling or awaiting its check, or while
        a placement or flow rule of the session names it."""
        with session.registering:
            self._deregister_device(session, device_id)

    def _deregister_device(self, session: Session, device_id: int) -> None:
        dev = self.core.device(session, device_id)
        self.core.plane.deliveries.check_landed()  # verdicts the client published count
        state = self.core.placements.naming(session.session_id, device_id)
        if state is not None:
            raise precondition(f"device {device_id} is in use: placement {state.placement_id} "
                               f"of model {state.model!r} places experts on it")
        for rule in self.core.flows.rules():
            if owned_by(rule, session.session_id) and device_id in rule.queues:
                raise precondition(f"device {device_id} is in use: flow rule {rule.rule_id} "
                                   "forwards to it")
        with session.lock:
            for rid, pool in dev.pools.items():
                busy = pool.busy_count()
                if busy:
                    raise precondition(f"device {device_id}: {busy} slot(s) of region {rid} "
                                       "held or under way; release them first")
            del session.devices[device_id]
        self.core.device_removed(dev)

    def register_region(self, session: Session, spec: RegionSpec) -> int:
        """Register ``spec`` on its device; returns the region id (the session's next). A DMA-
        engine device's pool is opened by the engine outside ``session.lock`` (a GPU pool's
        IPC handle takes time to open) and registered once it is."""
        rings: dict[RegionKind, Callable[[Session, Device, RegionSpec], None]] = {
            RegionKind.WORK_RING: self._device_ring,
            RegionKind.COMPLETION_RING: self._device_ring,
            RegionKind.RX_RING: self._packet_ring,
            RegionKind.TX_RING: self._packet_ring}
        with session.registering:
            try:
                return self._register_region(session, spec, rings)
            finally:
                with self._claims_lock:
                    self._claimed.pop(session.session_id, None)

    def _register_region(self, session: Session, spec: RegionSpec,
                         rings: dict[RegionKind, Callable[[Session, Device, RegionSpec], None]]
                         ) -> int:
        dev = self.core.device(session, spec.device_id)
        pool = None
        if spec.kind == RegionKind.SLOT_POOL:
            with session.lock:
                _check_room(session)
                pool = self._slot_pool(session, dev, spec)
            if dev.delivery == Delivery.DMA_ENGINE:
                self.core.plane.engine.add_pool(dev, pool)
        with session.lock:
            _check_room(session)
            if pool is None:
                rings[spec.kind](session, dev, spec)
            else:
                dev.pools[pool.region_id] = pool
            rid = session.next_region_id
            session.next_region_id += 1
            dev.regions[rid] = spec.kind
            return rid

    def _slot_pool(self, session: Session, dev: Device, spec: RegionSpec) -> SlotPool:
        """The pool ``spec`` describes, checked; registered by the caller."""
        if spec.ipc_handle and len(spec.ipc_handle) != IPC_HANDLE_BYTES:
            raise invalid(f"cuda_ipc_handle must be {IPC_HANDLE_BYTES} bytes "
                          f"(cudaIpcMemHandle_t), got {len(spec.ipc_handle)}")
        problem = pool_problem(spec.slot_bytes, spec.slot_count, spec.home_layers)
        if problem:
            raise invalid(problem)
        if spec.size_bytes < spec.slot_bytes * spec.slot_count:
            raise invalid(f"slot pool of {spec.slot_count} x {spec.slot_bytes} bytes does "
                          f"not fit in size_bytes {spec.size_bytes}")
        rid = session.next_region_id
        pool = SlotPool(rid, spec.slot_bytes, spec.slot_count, ipc_handle=spec.ipc_handle,
                        shm_name=spec.shm_name, channel=dev.channel,
                        state_base=_state_range(dev, spec.slot_count),
                        policy=self.core.slot_policy(), home_layers=spec.home_layers)
        if dev.delivery == Delivery.DMA_ENGINE:
            self._check_own(session, "slot pool", spec.shm_name, spec.ipc_handle)
        return pool

    def _device_ring(self, session: Session, dev: Device, spec: RegionSpec) -> None:
        """The work or completion ring of a device whose consumer pulls; its queue opens once
        both are registered."""
        if dev.delivery == Delivery.DMA_ENGINE:
            raise precondition(f"device {dev.device_id} is served by the DMA engine: "
                               "it has no work or completion ring of its own")
        if not spec.shm_name:
            raise invalid("a ring region needs shm_name (its export handle)")
        if dev.queue is not None:
            raise AgentError(ErrorKind.ALREADY_EXISTS,
                             f"device {dev.device_id} already has its rings")
        self._check_ring(session, spec)
        work = spec.kind == RegionKind.WORK_RING
        if work and dev.work_shm:
            raise AgentError(ErrorKind.ALREADY_EXISTS, "work ring already registered")
        if not work and dev.completion_shm:
            raise AgentError(ErrorKind.ALREADY_EXISTS, "completion ring already registered")
        if work:
            dev.work_shm = spec.shm_name
        else:
            dev.completion_shm = spec.shm_name
        if dev.work_shm and dev.completion_shm:
            try:
                dev.queue = DeviceQueue(dev.work_shm, dev.completion_shm)
            except (SharedBufferError, ValueError) as exc:
                if work:
                    dev.work_shm = ""
                else:
                    dev.completion_shm = ""
                raise invalid(f"cannot open device {dev.device_id} rings: {exc}") from exc
            self.core.devices_changed()  # after the queue exists: the poller rebuilds

    def _packet_ring(self, session: Session, dev: Device, spec: RegionSpec) -> None:
        """An rx or tx packet ring of the activation path."""
        ring_kind = _RING_KINDS[spec.kind]
        if spec.kind in dev.regions.values():
            raise AgentError(ErrorKind.ALREADY_EXISTS,
                             f"device {dev.device_id} already has its "
                             f"{ring_kind.name.lower()} ring")
        self._check_ring(session, spec)
        dev.packet_rings[ring_kind] = spec.shm_name

    def _check_ring(self, session: Session, spec: RegionSpec) -> None:
        """The ring is the session's own and a valid ring of its kind."""
        ring_kind = _RING_KINDS[spec.kind]
        what = f"{ring_kind.name.lower()} ring"
        self._check_own(session, what, spec.shm_name, b"")
        try:
            check_ring(spec.shm_name, ring_kind)
        except (SharedBufferError, RingError) as exc:
            raise invalid(f"{what} {spec.shm_name!r}: {exc}") from exc

    def _check_own(self, session: Session, region: str, shm_name: str, ipc_handle: bytes
                   ) -> None:
        """A region is one session's own: refuse shared memory whose name is not bound to the
        session's token (``shm.session_name``: only a holder of the token could have created
        it; names are listed in /dev/shm), and memory the agent already knows by that name or
        handle (the arena, any session's channel, rings or pools). The DMA engine writes a
        pool it is handed, and the agent writes work into a ring and reads completions from
        it. PERMISSION_DENIED names which."""
        if shm_name and session.binding is not None and not bound_to(shm_name,
                                                                     session.binding.digest):
            raise AgentError(ErrorKind.PERMISSION_DENIED,
                             f"{region}: shared memory {shm_name!r} was not created for this "
                             "session (its name is not bound to the session's token: "
                             "host_client names segments with shm.session_name)")
        with self._claims_lock:
            taken = self.core.exports().union(*self._claimed.values())
            for handle, what in ((shm_name, f"shared memory {shm_name!r}"),
                                 (ipc_handle, "that CUDA IPC handle")):
                if handle and handle in taken:
                    raise AgentError(ErrorKind.PERMISSION_DENIED,
                                     f"{region}: {what} is already the agent's or a "
                                     "registered region's; a region must be memory of its own")
            # Claimed until this registration ends: it may wait on the DMA engine before its
            # region shows in ``exports``.
            self._claimed.setdefault(session.session_id, set()).update(
                h for h in (shm_name, ipc_handle) if h)

    def deregister_region(self, session: Session, region_id: int) -> None:
        """Remove a slot pool with no delivery in flight (rings go with the session); a DMA-
        engine device's pool is closed in the engine too, so a restarted engine does not
        reopen memory the client may have freed."""
        with session.registering:
            with session.lock:
                dev, pool = self._pool_of(session, region_id)
                if any(s == SlotState.FILLING for s in pool.state):
                    raise precondition(f"region {region_id} has transfers in flight")
                self.core.plane.deliveries.forget(pool)
                del dev.pools[region_id]
                del dev.regions[region_id]
            if dev.delivery == Delivery.DMA_ENGINE:
                self.core.plane.engine.remove_pool(dev, pool)

    @staticmethod
    def _pool_of(session: Session, region_id: int) -> tuple[Device, SlotPool]:
        for dev in session.devices.values():
            pool = dev.pools.get(region_id)
            if pool is not None:
                return dev, pool
            if region_id in dev.regions:
                raise precondition(f"region {region_id} is a ring; close the session to "
                                   "remove it")
        raise not_found(f"region {region_id} is not registered in this session")

    def link_peers(self, session: Session, device_id: int, sources: list[int]) -> None:
        """Record that ``device_id``'s consumer can read the slot pools of ``sources``. A
        DMA-engine device has no consumer of its own: the engine reads the arena only."""
        dev = self.core.device(session, device_id)
        if dev.delivery == Delivery.DMA_ENGINE and sources:
            raise precondition(f"LinkPeers: device {device_id} is served by the DMA engine, "
                               "which copies from the arena, not from other devices' pools")
        for sid in sources:
            if sid == device_id:
                raise invalid(f"LinkPeers: device {device_id} cannot be its own source")
            self.core.device(session, sid)
        if len(set(sources)) != len(sources):
            raise invalid(f"LinkPeers: sources {sources} name a device twice")
        dev.peer_sources = tuple(sources)


def _check_room(session: Session) -> None:
    """The session is open and may register another region (``session.lock`` held)."""
    if session.closed:
        raise not_found(f"session {session.session_id} is closed")
    if session.next_region_id >= abi.MAX_REGIONS:
        raise AgentError(ErrorKind.RESOURCE_EXHAUSTED,
                         f"session holds the maximum of {abi.MAX_REGIONS} regions")


def _state_range(dev: Device, count: int) -> int:
    """The lowest index of ``count`` free entries in the device's slot-state table."""
    base = 0
    for pool in sorted(dev.pools.values(), key=lambda p: p.state_base):
        if pool.state_base - base >= count:
            break
        base = max(base, pool.state_base + pool.slot_count)
    if base + count > abi.MAX_CHANNEL_SLOTS:
        raise AgentError(ErrorKind.RESOURCE_EXHAUSTED,
                         f"device {dev.device_id}'s pools would hold more than "
                         f"{abi.MAX_CHANNEL_SLOTS} slots (the channel's slot-state table)")
    return base
