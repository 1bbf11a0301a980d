"""``python -m dma_engine``: the engine process. The agent writes one JSON command per line on
stdin and reads one JSON answer per line on stdout; the data path polls on the main thread.

Commands: ``attach`` (device id, kind, ordinal, arena, ring names, the device's channel, whose
slot-state table SIGNALs write), ``pool`` / ``unpool`` (a slot pool by region id), ``detach``.
Every answer is ``{"ok": true, ...}`` or ``{"ok": false, "error": "what was wrong"}``; a command
that fails changes nothing.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys
import threading
from typing import Any

from dma_engine.engine import Engine, Target
from dma_engine.signals import SlotStates
from dpu_offload import abi
from dpu_offload.bell import Bell
from dpu_offload.ring import Ring, RingError
from dpu_offload.shm import SharedBuffer, SharedBufferError

log = logging.getLogger("dma_engine")


def _ring(name: str, kind: abi.RingKind, buffers: list[SharedBuffer]) -> Ring:
    buf = SharedBuffer(name)
    buffers.append(buf)
    return Ring(buf.array, kind)


def attach(engine: Engine, cmd: dict[str, Any]) -> dict[str, Any]:
    device_id = int(cmd["device"])
    if device_id in engine.targets:
        raise ValueError(f"device {device_id} is already attached")
    backend = engine.backend(str(cmd["kind"]), int(cmd.get("ordinal", 0)))
    buffers: list[SharedBuffer] = []
    states = target = None
    try:
        channel = cmd["channel"]
        states = SlotStates(str(channel["name"]), int(channel["size"]))
        target = Target(device_id, backend, _ring(cmd["work"], abi.RingKind.WORK, buffers),
                        _ring(cmd["completions"], abi.RingKind.COMPLETION, buffers), states,
                        buffers)
        arena = cmd["arena"]
        target.regions[int(arena["region"])] = (
            backend.map_arena(arena["name"], int(arena["size"])), int(arena["size"]),
            abi.RegionFlags.READABLE, 0)
    except BaseException:
        if target is not None:
            target.close()  # its lane, states and buffers
            raise
        if states is not None:
            states.close()
        for buf in buffers:
            buf.close()
        raise
    with engine.lock:
        engine.targets[device_id] = target
    return {}


def pool(engine: Engine, cmd: dict[str, Any]) -> dict[str, Any]:
    target = engine.targets[int(cmd["device"])]
    region = int(cmd["region"])
    if not 0 < region < abi.MAX_REGIONS or int(target.regions[region]["size"]):
        raise ValueError(f"region {region} is not a free region id")
    base = target.backend.open_pool(cmd)
    with engine.lock:
        target.regions[region] = (base, int(cmd["size"]),
                                  abi.RegionFlags.READABLE | abi.RegionFlags.WRITABLE, 0)
    return {}


def unpool(engine: Engine, cmd: dict[str, Any]) -> dict[str, Any]:
    target = engine.targets[int(cmd["device"])]
    region = int(cmd["region"])
    with engine.lock:
        base = int(target.regions[region]["base"])
        target.regions[region] = 0
    target.backend.close_pool(base)
    return {}


def detach(engine: Engine, cmd: dict[str, Any]) -> dict[str, Any]:
    with engine.lock:
        target = engine.targets.pop(int(cmd["device"]), None)
    if target is not None:
        target.close()
    return {}


COMMANDS = {"attach": attach, "pool": pool, "unpool": unpool, "detach": detach}


def control(engine: Engine) -> None:
    """Serve commands until stdin closes (the agent went away), then stop the engine."""
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            answer = {"ok": True, **COMMANDS[cmd["op"]](engine, cmd)}
        except (KeyError, ValueError, TypeError, RingError, SharedBufferError, OSError,
                RuntimeError) as exc:  # CUDA errors are RuntimeErrors
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    engine.stopping = True


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="dma-engine %(levelname)s %(message)s")
    ap = argparse.ArgumentParser(prog="python -m dma_engine")
    ap.add_argument("--bell", default="",
                    help="shared-memory name of the doorbell the agent rings after posting work "
                         "(the engine sleeps on it when idle; without it, it naps)")
    ap.add_argument("--agent-bell", default="",
                    help="shared-memory name of the agent's doorbell, rung after completions "
                         "are pushed (without it, the agent polls for them)")
    ap.add_argument("--poll", action="store_true",
                    help="poll the work rings without sleeping while a device is attached (a "
                         "core of its own, as the DMA engine this stands for is hardware)")
    args = ap.parse_args()
    bells = []
    for flag, name in (("--bell", args.bell), ("--agent-bell", args.agent_bell)):
        try:
            bells.append(Bell.open(name) if name else None)
        except (SharedBufferError, ValueError) as exc:
            ap.error(f"{flag} {name!r}: {exc}")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, for a hang
    engine = Engine(*bells, polls=args.poll)
    threading.Thread(target=control, args=(engine,), name="control", daemon=True).start()
    sys.stdout.write(json.dumps({"ok": True, "ready": True}) + "\n")
    sys.stdout.flush()
    try:
        engine.run()
    finally:
        engine.close()


if __name__ == "__main__":
    main()
