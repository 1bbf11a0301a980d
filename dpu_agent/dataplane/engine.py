"""The agent's supervision of the DMA-engine process (``python -m dma_engine``): started on
first use, commanded over its stdin/stdout (JSON lines), checked every sweep of the data-plane
loop. When it dies, ``on_death`` fails the transfers it had in hand and the engine is started
again with every target re-attached. The agent never imports CUDA; the engine does, for CUDA
targets only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpu_agent.dataplane.child import ChildError, ChildProcess
from dpu_agent.dataplane.queues import DeviceQueue, EngineRings
from dpu_agent.errors import invalid
from dpu_agent.registry import DeviceKind
from dpu_offload.bell import Bell

if TYPE_CHECKING:
    from dpu_agent.registry import Device
    from dpu_agent.slots import SlotPool

log = logging.getLogger("dpu_agent.engine")

class EngineError(ChildError):
    """The engine refused a command or is not running; the message says which and why."""


class EngineSupervisor(ChildProcess):
    """One DMA-engine process and the commands that rebuild its state after a restart.

    Args:
        on_death: called (from the sweeping thread) with the ids of the devices the dead
            engine served, before it is restarted; returns each one's attach command for the
            new engine (fresh rings: the dead engine's unconsumed work must not run).
    """

    def __init__(self, on_death: Callable[[list[int]], dict[int, dict[str, Any]]],
                 bell: str = "", agent_bell: str = "", polls: bool = False) -> None:
        # The engine's command line: the doorbells' shared-memory names (the one it sleeps on
        # when idle, the agent's it rings after completing work), and ``--poll`` where it
        # polls without sleeping while it serves a device.
        super().__init__("the DMA engine", "dma_engine",
                         [*(["--bell", bell] if bell else []),
                          *(["--agent-bell", agent_bell] if agent_bell else []),
                          *(["--poll"] if polls else [])])
        self._on_death = on_death
        self._targets: dict[int, dict[str, Any]] = {}
        """device id -> its attach command; pools in ``_pools``."""
        self._pools: dict[int, dict[int, dict[str, Any]]] = {}
        self.restarts = 0

    def _call_locked(self, cmd: dict[str, Any]) -> dict[str, Any]:
        try:
            return super()._call_locked(cmd)
        except ChildError as exc:
            raise EngineError(str(exc)) from exc

    def attach(self, device_id: int, cmd: dict[str, Any]) -> None:
        with self._lock:
            self._call_locked({"op": "attach", "device": device_id, **cmd})
            self._targets[device_id] = cmd
            self._pools[device_id] = {}

    def add_pool(self, device_id: int, region_id: int, spec: dict[str, Any]) -> None:
        with self._lock:
            self._call_locked({"op": "pool", "device": device_id, "region": region_id, **spec})
            self._pools[device_id][region_id] = spec

    def remove_pool(self, device_id: int, region_id: int) -> None:
        with self._lock:
            if self._pools.get(device_id, {}).pop(region_id, None) is not None:
                self._call_locked({"op": "unpool", "device": device_id, "region": region_id})

    def detach(self, device_id: int) -> None:
        with self._lock:
            if self._targets.pop(device_id, None) is None:
                return
            self._pools.pop(device_id, None)
            try:
                self._call_locked({"op": "detach", "device": device_id})
            except EngineError as exc:
                log.warning("detach of device %d: %s", device_id, exc)

    def check(self) -> None:
        """Restart a dead engine (a sweep of the data-plane loop calls this). Skipped while a
        command holds the engine: attaching a device can take a second (the engine's start,
        CUDA IPC opens), and the loop must not stall every other device's requests behind it;
        a later sweep looks again."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._reap_locked():
                return
            devices = list(self._targets)
        finally:
            self._lock.release()
        fresh = self._on_death(devices)
        with self._lock:
            self.restarts += 1
            self._targets.update({d: c for d, c in fresh.items() if d in self._targets})
            for device_id, cmd in list(self._targets.items()):
                try:
                    self._call_locked({"op": "attach", "device": device_id, **cmd})
                    for region_id, spec in self._pools[device_id].items():
                        self._call_locked({"op": "pool", "device": device_id,
                                           "region": region_id, **spec})
                except EngineError as exc:
                    log.error("re-attaching device %d to the DMA engine: %s", device_id, exc)


class EngineDevices:
    """The agent's devices served by the DMA engine: their rings to it, the commands that
    attach them and their pools, and what a dead engine leaves to redo.

    Args:
        arena_name, arena_size, arena_region: the arena the engine maps (bytes; region id).
        devices: every registered device (those with engine rings are the engine's).
        on_death: called with the dead engine's devices, after each got fresh rings and a fresh
            queue, so their transfers in flight can be failed.
        agent_bell: the agent's doorbell (shared-memory name), which the engine rings after it
            completes work ("" none: the agent must poll for completions).
        polls: the engine polls its rings without sleeping while it serves a device.
    """

    def __init__(self, arena_name: str, arena_size: int, arena_region: int,
                 devices: Callable[[], tuple[Device, ...]],
                 on_death: Callable[[set[Device]], None], agent_bell: str = "",
                 polls: bool = False) -> None:
        self._arena = {"name": arena_name, "size": arena_size, "region": arena_region}
        self._devices = devices
        self._on_death = on_death
        self.bell = Bell.create("dpu-engine-bell")
        """Rung after work is pushed to the engine (its loop sleeps on it when idle)."""
        self.supervisor = EngineSupervisor(self._died, self.bell.name, agent_bell, polls)

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    def stop(self) -> None:
        """Stop the engine and remove its doorbell's name."""
        self.supervisor.stop()
        self.bell.unlink()

    def _command(self, dev: Device, rings: EngineRings) -> dict[str, Any]:
        return {"kind": "cuda" if dev.kind == DeviceKind.CUDA else "cpu",
                "ordinal": dev.ordinal, "work": rings.work, "completions": rings.completions,
                "arena": self._arena, "channel": {"name": dev.channel.name,
                                                  "size": dev.channel.size}}

    def attach(self, dev: Device) -> DeviceQueue:
        """Agent-owned rings to the engine and the engine attached (pools follow as they are
        registered); returns the queue the agent posts on and reads completions from."""
        rings = EngineRings()
        try:
            queue = DeviceQueue(rings.work, rings.completions, self.bell)
        except BaseException:
            rings.close()
            raise
        try:
            self.supervisor.attach(dev.device_id, self._command(dev, rings))
        except BaseException:
            self.supervisor.detach(dev.device_id)
            queue.close()
            rings.close()
            raise
        dev.engine_rings = rings
        return queue

    @staticmethod
    def _spec(dev: Device, pool: SlotPool) -> dict[str, Any]:
        if dev.kind == DeviceKind.CUDA:
            if not pool.ipc_handle:
                raise invalid("a DMA-engine CUDA device's slot pool needs cuda_ipc_handle")
            return {"size": pool.slot_bytes * pool.slot_count, "ipc": pool.ipc_handle.hex()}
        if not pool.shm_name:
            raise invalid("a DMA-engine CPU reference device's slot pool needs shm_name")
        return {"size": pool.slot_bytes * pool.slot_count, "shm": pool.shm_name}

    def add_pool(self, dev: Device, pool: SlotPool) -> None:
        """Have the engine open ``pool``; INVALID_ARGUMENT when it cannot."""
        spec = self._spec(dev, pool)
        try:
            self.supervisor.add_pool(dev.device_id, pool.region_id, spec)
        except EngineError as exc:
            raise invalid(f"the DMA engine cannot open slot pool {pool.region_id}: {exc}"
                          ) from exc

    def remove_pool(self, dev: Device, pool: SlotPool) -> None:
        """Have the engine close ``pool`` (no transfer of it is in flight)."""
        try:
            self.supervisor.remove_pool(dev.device_id, pool.region_id)
        except EngineError as exc:
            log.warning("closing slot pool %d in the DMA engine: %s", pool.region_id, exc)

    def detach(self, dev: Device) -> None:
        self.supervisor.detach(dev.device_id)
        if dev.engine_rings is not None:
            dev.engine_rings.close()

    def _died(self, device_ids: list[int]) -> dict[int, dict[str, Any]]:
        """Fresh rings and queues for the dead engine's devices (so no descriptor it left
        unconsumed ever runs); returns their attach commands for the new engine."""
        devices = {d for d in self._devices()
                   if d.device_id in device_ids and d.engine_rings is not None}
        fresh = {}
        for dev in devices:
            old_rings, old_queue = dev.engine_rings, dev.queue
            rings = EngineRings()
            dev.queue = DeviceQueue(rings.work, rings.completions, self.bell)
            dev.engine_rings = rings
            fresh[dev.device_id] = self._command(dev, rings)
            if old_queue is not None:
                old_queue.close()
            if old_rings is not None:
                old_rings.close()
        self._on_death(devices)
        return fresh
