"""Sending activations (docs/ACTIVATIONS.md): :class:`ActivationSender` is what attention nodes
use: ``dispatch(layer, hidden, topk_ids, topk_weights)`` packs rows by expert, sends one
REQUEST per expert to the NIC stand-in (within its credits), and combines the answers weighted
by the gate probabilities. It never needs to know where an expert lives; the experts are
served by :class:`host_client.worker.ExpertWorker`.

Shapes and dtypes: ``hidden`` is ``uint16[tokens, hidden_size]`` holding bf16 bits;
``topk_ids`` ``int[tokens, k]``; ``topk_weights`` ``float32[tokens, k]``; the result is
``uint16[tokens, hidden_size]`` (bf16 bits).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import zmq
import zmq.auth

from dpu_offload import frames
from dpu_offload.frames import FrameError, FrameStatus, Kind
from gpu_kernels import moe_twin, reference
from gpu_kernels.routing import dispatch_plan


def curve_socket(kind: int, curve: tuple[str, str] | None) -> zmq.Socket:
    """A socket of ``kind``; with ``curve = (own secret certificate, agent's public
    certificate)`` (files from zmq.auth.create_certificates) it authenticates and encrypts."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        public, secret = zmq.auth.load_certificate(curve[0])
        server_public, _ = zmq.auth.load_certificate(curve[1])
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public
    return sock


PHASES = ("pack", "send", "receive", "combine")
"""A dispatch's phases on the sender: planning and packing the rows; sending the requests;
receiving the answers (waiting for them included) into place; combining them."""


class ActivationError(RuntimeError):
    """The NIC refused or could not serve a request; ``status`` says why, ``message_id``
    which request (0: none it could name)."""

    def __init__(self, status: FrameStatus, message: str, message_id: int = 0) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message_id = message_id


class ActivationSender:
    """Routes MoE layer inputs to their experts through the agent and combines the outputs.

    Args:
        address: the agent's activation socket, ``host:port``.
        model: model name (at most 16 bytes).
        experts: routed experts per layer.
        credits: requests kept outstanding at most (the agent's per-sender bound).
        curve: (own secret certificate, agent's public certificate) for CURVE.
    """

    def __init__(self, address: str, model: str, experts: int, credits: int = 64,
                 timeout: float = 60.0, curve: tuple[str, str] | None = None) -> None:
        self.model, self.experts, self.credits = model, experts, credits
        self.timeout_ms = int(timeout * 1000)
        self.sock = curve_socket(zmq.DEALER, curve)
        self.sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)  # a blocking receive, no Poller
        self.sock.connect(f"tcp://{address}")
        self._ids = itertools.count(1)
        self._kept: tuple[np.ndarray, np.ndarray] | None = None
        """Flat ``uint16`` buffers of the packed rows and of their answers."""
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        """Seconds (``time.perf_counter``) spent in each of :data:`PHASES`, summed over every
        dispatch: where a layer's time goes on the sender's side."""

    def request(self, layer: int, expert: int, rows: np.ndarray) -> int:
        """Send one REQUEST (``rows``: ``uint16[n, hidden]``); returns its message id."""
        mid = next(self._ids)
        rows = np.ascontiguousarray(rows)
        self.sock.send_multipart([frames.pack(
            Kind.REQUEST, mid, self.model, layer, expert, rows.shape[0],
            rows.shape[1] * rows.itemsize, rows.nbytes), rows], copy=False)
        return mid

    def receive(self) -> tuple[int, np.ndarray]:
        """The next answer: (message id, output rows ``uint16[n, hidden]``). Waited for asleep:
        polling for it first held the GIL from a worker thread of the same process (measured on
        the H200 in the twenty-second session: no gain with the resident receiver, its thread
        worker 1.8x slower at 8 KiB)."""
        try:
            header, payload = self.sock.recv_multipart(copy=False)
        except zmq.Again:
            raise TimeoutError(f"no answer from the agent in {self.timeout_ms} ms") from None
        try:
            h = frames.unpack(header.bytes, len(payload.buffer))
        except FrameError as exc:
            raise ActivationError(exc.status, f"an answer the sender cannot read: {exc}"
                                  ) from None
        if h.kind != Kind.RESPONSE:
            raise ActivationError(FrameStatus(h.status), payload.bytes.decode(errors="replace"),
                                  h.message_id)
        if h.row_bytes % 2:
            raise ActivationError(FrameStatus.BAD_FRAME, f"the answer to message "
                                  f"{h.message_id} has rows of {h.row_bytes} bytes (bf16: even)",
                                  h.message_id)
        out = np.frombuffer(payload.buffer, np.uint16).reshape(h.rows, h.row_bytes // 2)
        return h.message_id, out

    def dispatch(self, layer: int, hidden: np.ndarray, topk_ids: np.ndarray,
                 topk_weights: np.ndarray) -> np.ndarray:
        """One MoE layer through the offloaded experts: each row sent to the experts it chose
        (wherever placement serves them), the answers combined by the routing weights.

        Args:
            layer: the MoE layer's number in the checkpoint.
            hidden: ``uint16[tokens, hidden_size]``, the rows as bf16 bits.
            topk_ids: ``int[tokens, k]``, each row's experts (below the model's expert count).
            topk_weights: ``float32[tokens, k]``, their weights.

        Returns:
            ``uint16[tokens, hidden_size]``: the combined outputs as bf16 bits.
        """
        hidden = np.asarray(hidden)
        if hidden.dtype != np.uint16 or hidden.ndim != 2:
            raise ValueError(f"hidden must be uint16[tokens, hidden_size] (bf16 bits), got "
                             f"{hidden.dtype}{list(hidden.shape)}")
        phases, t0 = self.phase_seconds, time.perf_counter()
        plan = dispatch_plan(np, np.asarray(topk_ids), self.experts)
        # Rows go out of, and answers come into, buffers kept across layers (fresh ones are
        # faulted in on every call); a dispatch that fails drops them, since a request it
        # left queued may still be read from them.
        rows, width = plan.order.size, hidden.shape[1]
        kept, self._kept = self._kept, None
        if kept is None or kept[0].size < rows * width:
            kept = (np.empty(rows * width, np.uint16), np.empty(rows * width, np.uint16))
        packed, outputs = (b[:rows * width].reshape(rows, width) for b in kept)
        reference.dispatch(hidden, plan, out=packed)
        offsets = plan.offsets
        where: dict[int, tuple[int, int]] = {}
        todo = [e for e in range(self.experts) if offsets[e + 1] > offsets[e]]
        outstanding = 0
        t = time.perf_counter()
        phases["pack"] += t - t0
        while todo or outstanding:
            while todo and outstanding < self.credits:
                e = todo.pop(0)
                mid = self.request(layer, e, packed[offsets[e]:offsets[e + 1]])
                where[mid] = (int(offsets[e]), int(offsets[e + 1]))
                outstanding += 1
            now = time.perf_counter()
            phases["send"], t = phases["send"] + now - t, now
            try:
                if self._take_answer(where, outputs):
                    outstanding -= 1
            finally:
                now = time.perf_counter()
                phases["receive"], t = phases["receive"] + now - t, now
        self._kept = kept
        combined = moe_twin.combine_bf16(outputs, plan, np.asarray(topk_weights, np.float32))
        phases["combine"] += time.perf_counter() - t
        return combined

    def _take_answer(self, where: dict[int, tuple[int, int]], outputs: np.ndarray) -> bool:
        """Receive one answer into its rows of ``outputs`` (``where``: message id -> its rows,
        taken out once answered); False for the late answer or refusal of a dispatch that
        failed before it came."""
        try:
            mid, out = self.receive()
        except ActivationError as exc:
            if exc.message_id in where or not exc.message_id:
                raise
            return False
        if mid not in where:
            return False
        lo, hi = where.pop(mid)
        if out.shape != (hi - lo, outputs.shape[1]):
            raise ActivationError(FrameStatus.BAD_FRAME, f"the answer to message {mid} holds "
                                  f"{list(out.shape)} rows, expected "
                                  f"{[hi - lo, outputs.shape[1]]}", mid)
        outputs[lo:hi] = out
        return True

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> ActivationSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
