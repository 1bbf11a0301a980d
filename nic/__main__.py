"""``python -m nic``: the NIC stand-in's process. The agent writes one JSON command per line on
stdin and reads one JSON answer per line on stdout; the data path polls on the main thread.

Commands: ``attach`` (device id, the shared-memory names of its rx and tx packet rings),
``detach`` (device id), ``stats`` (counters), ``start`` (the agent attached the ports it had:
frames are taken from the socket from now on). Every answer is
``{"ok": true, ...}`` or ``{"ok": false, "error": "what was wrong"}``; a command that fails
changes nothing. The first line it writes is ``{"ok": true, "ready": true, "port": P}``, the
port it bound.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dpu_offload.ring import RingError
from dpu_offload.shm import SharedBufferError
from dpu_offload.steering_snapshot import SnapshotError, SnapshotSegment
from gpu_kernels import packet_twin
from nic.nic import Nic

log = logging.getLogger("nic")


def _device(cmd: dict[str, Any]) -> int:
    device = cmd["device"]
    if not isinstance(device, int) or device < 0:
        raise ValueError(f"device {device!r} is not a device id")
    return device


COMMANDS: dict[str, Callable[[Nic, dict[str, Any]], dict[str, Any]]] = {
    "attach": lambda nic, c: nic.attach(_device(c), str(c["rx"]), str(c["tx"])) or {},
    "detach": lambda nic, c: nic.detach(_device(c)) or {},
    "stats": lambda nic, c: {"stats": nic.stats()},
    "start": lambda nic, c: nic.started.set() or {},
}


def control(nic: Nic) -> None:
    """Serve commands until stdin closes (the agent went away), then stop the NIC."""
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            answer = {"ok": True, **COMMANDS[cmd["op"]](nic, cmd)}
        except (KeyError, ValueError, TypeError, RingError, SharedBufferError,
                OSError) as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    nic.stopping = True
    nic.started.set()


def bind(address: str, curve_server_cert: str, curve_clients_dir: str
         ) -> tuple[zmq.Socket, int, ThreadAuthenticator | None]:
    """The ROUTER socket senders connect to, bound to ``address`` (port 0: any free one); with
    CURVE only the clients whose public certificates are in ``curve_clients_dir`` get in."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    auth = None
    if curve_server_cert:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=curve_clients_dir)
        public, secret = zmq.auth.load_certificate(curve_server_cert)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True
    host, _, port = address.rpartition(":")
    if port == "0":
        return sock, sock.bind_to_random_port(f"tcp://{host}"), auth
    sock.bind(f"tcp://{address}")
    return sock, int(port), auth


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="nic %(levelname)s %(message)s")
    ap = argparse.ArgumentParser(prog="python -m nic")
    ap.add_argument("--listen", required=True, help="host:port senders connect to (port 0: any)")
    ap.add_argument("--snapshot", required=True,
                    help="shared-memory name of the agent's steering snapshot")
    ap.add_argument("--credits", type=int, default=64, help="requests outstanding per sender")
    ap.add_argument("--worker-timeout", type=float, default=5.0,
                    help="seconds a worker (or peer agent) may take to answer")
    ap.add_argument("--curve-server-cert", default="")
    ap.add_argument("--curve-clients-dir", default="")
    args = ap.parse_args()
    if args.credits < 1 or args.worker_timeout <= 0:
        ap.error("--credits and --worker-timeout must be positive")
    try:
        segment = SnapshotSegment(args.snapshot)
    except (SharedBufferError, SnapshotError) as exc:
        ap.error(f"--snapshot {args.snapshot!r}: {exc}")
    try:
        sock, port, auth = bind(args.listen, args.curve_server_cert, args.curve_clients_dir)
    except (zmq.ZMQError, OSError, ValueError) as exc:
        ap.error(f"--listen {args.listen}: cannot bind ({exc})")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, for a hang
    packet_twin.warm_up()
    nic = Nic(sock, segment, args.credits, args.worker_timeout)
    threading.Thread(target=control, args=(nic,), name="control", daemon=True).start()
    sys.stdout.write(json.dumps({"ok": True, "ready": True, "port": port}) + "\n")
    sys.stdout.flush()
    try:
        nic.run()
    finally:
        nic.close()
        segment.close()
        if auth is not None:
            auth.stop()


if __name__ == "__main__":
    main()
