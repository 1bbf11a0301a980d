"""Peer weight fetch: an agent streams an expert's chunks from its arena to another agent over
ZeroMQ; the receiver checks every chunk against the checksums computed when the sender filled
its arena, and moves on to the next source on any failure.

Wire format (docs/CLUSTER.md): request ``[b"GET", b"model/layer/expert"]`` to the ROUTER;
answer ``[b"OK", header JSON {blob_bytes, chunk_bytes, checksums}, chunk 0, chunk 1, ...]`` or
``[b"MISS", reason]``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import zmq

from dpu_agent.weights.cache import WeightCache
from dpu_offload.checksum import chunk_checksum
from dpu_offload.keys import ExpertKey

T = TypeVar("T")

log = logging.getLogger("dpu_agent.cluster")


class PeerFetchError(RuntimeError):
    """No peer delivered the expert intact; the message lists what each one did."""


class PeerServer:
    """Serves resident experts to other agents (a ROUTER socket and its thread)."""

    def __init__(self, cache: WeightCache, address: str) -> None:
        self.cache = cache
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host, port = address.rsplit(":", 1)
        self.port = (self.sock.bind_to_random_port(f"tcp://{host}") if port == "0" else
                     (self.sock.bind(f"tcp://{address}"), int(port))[1])
        self.host = host
        self.served_bytes = 0
        self.misses = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peer-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            parts = self.sock.recv_multipart()
            identity, body = parts[0], parts[1:]
            try:
                if len(body) != 2 or body[0] != b"GET":
                    raise ValueError(f"expected [GET, key], got {len(body)} frames")
                key = ExpertKey.parse(body[1].decode())
            except ValueError as exc:
                self.sock.send_multipart([identity, b"MISS", f"bad request: {exc}".encode()])
                continue
            cached = self.cache.peek(key)
            if cached is None:
                self.misses += 1
                self.sock.send_multipart([identity, b"MISS", f"{key} not resident".encode()])
                continue
            try:
                n = cached.entry.blob_bytes
                step = self.cache.chunk_bytes
                blob = self.cache.arena.view(cached.offset, n)
                header = json.dumps({"blob_bytes": n, "chunk_bytes": step,
                                     "checksums": cached.checksums}).encode()
                # copy=True: the arena block may be reused once the pin below is released.
                self.sock.send_multipart([identity, b"OK", header,
                                          *(blob[i:i + step] for i in range(0, n, step))])
                self.served_bytes += n
            finally:
                self.cache.release(cached)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)


class PeerLinks:
    """This agent's connections to other agents' peer servers: one DEALER socket per address,
    kept between fetches (a fresh one cost ~1 ms of connecting per expert on loopback). One
    request at a time on a socket; a socket whose answer did not come, or came malformed, is
    closed, so a late answer is never read as the next one's. One caller at a time (the
    cluster agent calls it under its lock: a ZeroMQ socket may change threads only across a
    barrier)."""

    def __init__(self) -> None:
        self._socks: dict[str, zmq.Socket] = {}

    def fetch(self, key: ExpertKey, dest: np.ndarray, peers: Sequence[str], chunk_bytes: int,
              timeout: float = 5.0) -> list[int]:
        """Fill ``dest`` (``uint8[blob_bytes]``) with ``key``'s blob from the first of
        ``peers`` (host:port) that delivers it intact; returns the per-chunk checksums
        (``chunk_bytes``).

        Raises:
            PeerFetchError: every peer missed, timed out or sent a chunk failing its checksum.
        """
        tried = []
        for peer in peers:
            sock = self._socks.get(peer)
            if sock is None:
                sock = self._socks[peer] = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{peer}")
            sock.send_multipart([b"GET", str(key).encode()])
            if not sock.poll(int(timeout * 1000)):
                tried.append(f"{peer}: no answer in {timeout} s")
                self._drop(peer)
                continue
            parts = sock.recv_multipart(copy=False)
            problem = _land(parts, dest, chunk_bytes)
            if problem is None:
                return list(json.loads(parts[1].bytes)["checksums"])
            tried.append(f"{peer}: {problem}")
            if parts[0].bytes != b"MISS":  # an answer we could not use: start afresh
                self._drop(peer)
        raise PeerFetchError(f"{key}: no peer delivered it ({'; '.join(tried) or 'no peers'})")

    def _drop(self, peer: str) -> None:
        sock = self._socks.pop(peer, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for peer in list(self._socks):
            self._drop(peer)


def _land(parts: list[zmq.Frame], dest: np.ndarray, chunk_bytes: int) -> str | None:
    """Verify and copy an OK answer into ``dest``; the problem as text, None when intact."""
    if parts[0].bytes != b"OK":
        return parts[-1].bytes.decode(errors="replace")
    try:
        h = json.loads(parts[1].bytes)
        n, step, sums = int(h["blob_bytes"]), int(h["chunk_bytes"]), list(h["checksums"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"bad header ({exc})"
    if n != dest.size or step != chunk_bytes or len(sums) != -(-n // step) \
            or len(parts) != 2 + len(sums):
        return (f"answer shape ({n} bytes in {len(parts) - 2} chunks of {step}) does not match "
                f"the expert ({dest.size} bytes, chunks of {chunk_bytes})")
    for i, frame in enumerate(parts[2:]):
        start = i * step
        if len(frame.buffer) != min(step, n - start):
            return f"chunk {i} has {len(frame.buffer)} bytes"
        if chunk_checksum(frame.buffer, start) != sums[i]:
            return f"chunk {i} failed its checksum"
        dest[start:start + len(frame.buffer)] = np.frombuffer(frame.buffer, np.uint8)
    return None


@dataclass
class SourceRates:
    """Measured fill rates (bytes/s, exponentially weighted) of peers and storage, so fills
    prefer the faster. ``mode``: "auto" (measured; an unmeasured source is tried first),
    "always" or "never" (peers)."""

    mode: str = "auto"
    alpha: float = 0.3
    rates: dict[str, float] = field(default_factory=dict)

    def prefer_peer(self) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        peer, storage = self.rates.get("peer"), self.rates.get("storage")
        return peer is None or storage is None or peer >= storage

    def timed(self, source: str, nbytes: int, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        out = fn()
        rate = nbytes / max(time.perf_counter() - start, 1e-9)
        old = self.rates.get(source)
        self.rates[source] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        return out
