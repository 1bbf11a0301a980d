"""The NIC stand-in's links to the NICs of other agents (cluster mode): a REQUEST for an expert
no local device serves goes to the agent that holds it, under the NIC's own message id, and
its answer comes back on the same link (docs/ACTIVATIONS.md, "Across agents").

Wire: ``[header, payload]`` frames (``dpu_offload.frames``) on a DEALER socket per peer
address, connected on first use; the peer's NIC sees an ordinary sender.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

import numpy as np
import zmq

from dpu_offload import frames
from dpu_offload.frames import FrameError, FrameStatus, Header, Kind

log = logging.getLogger("nic")


class Remotes:
    """One DEALER socket per peer agent's NIC, registered with the NIC loop's poller.

    Args:
        poller: the NIC loop's.
        refused: the NIC's refusal counters (a malformed answer counts as BAD_PEER_FRAME).
    """

    def __init__(self, poller: zmq.Poller, refused: Counter[str]) -> None:
        self._poller = poller
        self._refused = refused
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, address: str, nid: int, h: Header, payload: np.ndarray) -> None:
        """Send a sender's REQUEST (header ``h``) to the NIC at ``address`` (host:port) as
        message ``nid``."""
        sock = self._socks.get(address)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{address}")
            self._socks[address] = sock
            self._poller.register(sock, zmq.POLLIN)
        sock.send_multipart([frames.pack(Kind.REQUEST, nid, h.model_name, h.layer, h.expert,
                                         h.rows, h.row_bytes, payload.size), payload],
                            copy=False)

    def answers(self, ready: dict[zmq.Socket, int]) -> Iterator[tuple[Header, zmq.Frame]]:
        """The well-formed answers waiting on the sockets ``ready`` (a poll's result) names:
        (header, payload frame); malformed ones are counted and logged."""
        for address, sock in list(self._socks.items()):
            if sock not in ready:
                continue
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    if len(parts) != 2:
                        raise FrameError(FrameStatus.BAD_FRAME, f"{len(parts)} frames")
                    h = frames.unpack(parts[0].bytes, len(parts[1].buffer))
                except FrameError as exc:
                    self._refused["BAD_PEER_FRAME"] += 1
                    log.warning("a frame from the peer agent at %s refused: %s", address, exc)
                    continue
                yield h, parts[1]

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
