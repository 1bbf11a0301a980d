"""The activation path on the host side (docs/ACTIVATIONS.md).

- :class:`ExpertWorker` serves the experts of one registered device: a DELIVER frame from the
  agent is written by the "NIC" (this thread) into the device's rx packet ring, the receive
  twin lands the rows in the expert's input buffer with checksums verified (a part with refused
  packets is delivered again, ``PACKET_RETRIES`` times at most, and counted), the expert's
  SwiGLU FFN runs on the weights in its slot, the send twin packetizes the output into the tx
  ring, and the NIC returns it to the agent as a RESULT.
- :class:`ActivationSender` is what attention nodes use: ``dispatch(layer, hidden, topk_ids,
  topk_weights)`` packs rows by expert, sends one REQUEST per expert through the agent (within
  its credits), and combines the answers weighted by the gate probabilities. It never needs
  to know where an expert lives.

Shapes and dtypes: ``hidden`` is ``uint16[tokens, hidden_size]`` holding bf16 bits;
``topk_ids`` ``int[tokens, k]``; ``topk_weights`` ``float32[tokens, k]``; the result is
``uint16[tokens, hidden_size]`` (bf16 bits).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
import zmq.auth
from prometheus_client import Counter

from dpu_offload import frames
from dpu_offload.frames import FrameStatus, Kind
from dpu_offload.keys import ExpertKey
from dpu_offload.ring import Ring
from dpu_offload.v1 import agent_pb2 as pb
from gpu_kernels import gpt_oss, reference
from gpu_kernels.routing import dispatch_plan
from host_client.client import AgentClient
from host_client.registration import AttachedDevice


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


class ActivationError(RuntimeError):
    """The agent refused or could not serve a request; ``status`` says why."""

    def __init__(self, status: FrameStatus, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status


PACKET_RETRIES = 2
"""Times a payload part whose packets failed their checksum is delivered again before the
request fails with WORKER_FAILED."""
PACKETS_REFUSED = Counter("dpu_worker_packets_refused", "Activation packets that failed their "
                          "checksum in an expert worker's rx ring.", ["device"])
PACKET_RETRANSMITS = Counter("dpu_worker_packet_retransmits", "Activation payload parts "
                             "delivered again after refused packets.", ["device"])


def expert_ffn(x: Any, gate: Any, up: Any, down: Any) -> Any:
    """An expert's SwiGLU FFN on the device holding ``x`` (shapes and dtypes as
    :func:`gpu_kernels.reference.swiglu_bf16`): on a GPU the fused kernel
    (gpu_kernels/expert_ffn.cu, two launches) for up to ``FFN_MAX_ROWS`` rows, as in decode;
    the array formula (cuBLAS on a GPU, NumPy otherwise) for larger batches."""
    if reference.array_module(x) is not np:
        from gpu_kernels import cuda_ops

        if x.shape[0] <= cuda_ops.FFN_MAX_ROWS:
            return cuda_ops.swiglu_bf16(x, gate, up, down)
    return reference.swiglu_bf16(x, gate, up, down)


class ExpertWorker:
    """Serves activation requests for the experts resident on ``dev``: on a CUDA device the
    packet-receive and send kernels move the rows and the FFN runs in CuPy; on the CPU
    reference device their NumPy twins and NumPy do."""

    def __init__(self, client: AgentClient, dev: AttachedDevice, host: str = "127.0.0.1",
                 curve: tuple[str, str] | None = None) -> None:
        if not client.activations_port:
            raise ValueError("the agent has no [activations] listen_address")
        self.client, self.dev = client, dev
        self.sock = curve_socket(zmq.DEALER, curve)
        self.sock.connect(f"tcp://{host}:{client.activations_port}")
        hello = f"{client.session_id}:{dev.device_id}".encode()
        self.sock.send_multipart([frames.pack(Kind.HELLO, payload_bytes=len(hello)), hello])
        reply = self.sock.recv_multipart()
        h = frames.unpack(reply[0], len(reply[1]))
        if int(h["kind"]) != Kind.RESPONSE:
            raise ActivationError(FrameStatus(int(h["status"])), reply[1].decode())
        self.served = 0
        self.refused_packets = 0
        """rx packets that failed their checksum (also ``dpu_worker_packets_refused_total``)."""
        self.retransmits = 0
        """Payload parts delivered again after a refusal
        (``dpu_worker_packet_retransmits_total``)."""
        self.xp: Any = np
        self.ops: Any = None
        """gpu_kernels.cuda_ops on a CUDA device; None: the NumPy twins."""
        if dev.device.kind == pb.DEVICE_KIND_CUDA:
            import cupy

            from gpu_kernels import cuda_ops

            self.xp, self.ops = cupy, cuda_ops
        self._generation = client.generation
        self._slots: dict[ExpertKey, Any] = {}
        """Experts this worker holds (one reference each, released on close): serving a
        placed expert costs no RPC."""
        self._ffn: dict[ExpertKey, Callable[[Any], Any]] = {}
        """Each held expert's FFN, rows (bf16 bits ``uint16[rows, hidden]``) -> rows, its
        weights ready (``_keep``)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="expert-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            header, payload = self.sock.recv_multipart(copy=False)
            h = frames.unpack(header.bytes, len(payload.buffer))
            try:
                out = self._serve(h, np.frombuffer(payload.buffer, np.uint8))
                reply = frames.pack(Kind.RESULT, int(h["message_id"]), frames.model_of(h),
                                    int(h["layer"]), int(h["expert"]), int(h["rows"]),
                                    int(h["row_bytes"]), out.nbytes)
                self.sock.send_multipart([reply, out], copy=False)
                self.served += 1
            except Exception as exc:  # noqa: BLE001 - answered, never dropped
                text = f"{type(exc).__name__}: {exc}".encode()
                self.sock.send_multipart([frames.pack(
                    Kind.ERROR, int(h["message_id"]), frames.model_of(h), int(h["layer"]),
                    int(h["expert"]), payload_bytes=len(text),
                    status=FrameStatus.WORKER_FAILED), text])

    def hold(self, keys: list[ExpertKey]) -> None:
        """Acquire ``keys`` now (one AcquireBatch) so that serving them later costs no RPC.
        ValueError (the rest released) for an expert the worker cannot compute."""
        handles = self.client.acquire_batch(self.dev, keys)
        for i, (key, handle) in enumerate(zip(keys, handles, strict=True)):
            try:
                self._keep(key, handle.wait(120))
            except BaseException:
                self.client.release_batch(self.dev, keys[i + 1:])
                raise

    def _keep(self, key: ExpertKey, slot: Any) -> Any:
        """Hold ``slot`` for ``key`` with its FFN ready to run. SwiGLU: weights widened to
        float32 on the CPU (NumPy has no BF16 GEMM), C-contiguous on a GPU for the fused
        kernel (a copy only where the checkpoint keeps them transposed). Clamped SwiGLU
        (gpt-oss, BF16 or MXFP4): weights and biases widened to float32 on either (the array
        formula, cuBLAS on a GPU). ValueError for an expert the worker cannot compute."""
        try:
            if slot.manifest.activation == pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU:
                w = slot.clamped_swiglu_weights()
                arrays = [self.xp.ascontiguousarray(a) for a in
                          (w.gate, w.up, w.down, w.gate_bias, w.up_bias, w.down_bias)]
                self._ffn[key] = lambda x: gpt_oss.clamped_swiglu_f32_weights(
                    x, *arrays, w.alpha, w.limit)
            else:
                weights = slot.swiglu_weights()
                if self.ops is None:
                    widened = [reference.bf16_to_f32(w) for w in weights]
                    self._ffn[key] = lambda x: reference.swiglu_f32_weights(x, *widened)
                else:
                    kept = [self.xp.ascontiguousarray(w) for w in weights]
                    self._ffn[key] = lambda x: expert_ffn(x, *kept)
        except ValueError:
            self.client.release(self.dev, key)
            raise
        self._slots[key] = slot
        return slot

    @staticmethod
    def _nic_deliver(rx: Ring, part: np.ndarray, h: np.void, key: ExpertKey) -> int:
        """The NIC's step (on a DPU, GPUNetIO's receive queue): ``part`` of the request's
        payload (``uint8``, this worker's copy of the frame) lands in the rx ring as checksummed
        packets; returns how many."""
        return reference.send_packets(rx, part, int(h["message_id"]), 0, key.layer, key.expert)

    def _serve(self, h: np.void, payload: np.ndarray) -> np.ndarray:
        key = ExpertKey(frames.model_of(h), int(h["layer"]), int(h["expert"]))
        rows, row_bytes = int(h["rows"]), int(h["row_bytes"])
        rx, tx = self.dev.rx.ring, self.dev.tx.ring
        inputs = self.xp.zeros(rows * row_bytes, np.uint8)
        device = str(self.dev.device_id)
        for start in range(0, payload.size, rx.payload.shape[1] * rx.capacity):
            part = payload[start:start + rx.payload.shape[1] * rx.capacity]
            view = inputs[start:start + part.size]
            for attempt in range(PACKET_RETRIES + 1):
                packets = self._nic_deliver(rx, part, h, key)
                # Receive kernel (or twin): land the rows in the expert's input buffer.
                if self.ops is None:
                    _, written, refused = reference.receive_packets(rx, view)
                else:
                    _, written, refused = self.ops.receive_packets(
                        rx, self.dev.rx_device_ptr, view, packets)
                # A packet whose length was cut to 0 (checksum 0) is valid but carries nothing:
                # the part is whole only if every byte of it was written.
                if not refused and written == part.size:
                    break
                self.refused_packets += refused
                PACKETS_REFUSED.labels(device).inc(refused)
                if attempt == PACKET_RETRIES:
                    raise ValueError(f"{refused} packets failed their checksum and "
                                     f"{written} of {part.size} bytes landed, "
                                     f"{PACKET_RETRIES + 1} times")
                self.retransmits += 1  # the NIC delivers the part again from its source
                PACKET_RETRANSMITS.labels(device).inc()
        if self.client.generation != self._generation:
            self._slots.clear()  # the agent restarted: earlier slots are gone
            self._ffn.clear()
            self._generation = self.client.generation
        slot = self._slots.get(key)
        if slot is None:
            slot = self._keep(key, self.client.acquire(self.dev, key).wait(60))
        x = inputs.view(np.uint16).reshape(rows, row_bytes // 2)
        out = self._ffn[key](x)
        # Send kernel (or twin): packetize the output into the tx ring; the NIC reads it out.
        flat = out.view(np.uint8).reshape(-1)
        result = np.empty(flat.size, np.uint8)
        for start in range(0, flat.size, tx.payload.shape[1] * tx.capacity):
            part = flat[start:start + tx.payload.shape[1] * tx.capacity]
            if self.ops is None:
                reference.send_packets(tx, part, int(h["message_id"]), 0, key.layer,
                                       key.expert)
            else:
                self.ops.send_packets(tx, self.dev.tx_device_ptr, part, int(h["message_id"]),
                                      0, key.layer, key.expert)
                self.xp.cuda.get_current_stream().synchronize()
            reference.receive_packets(tx, result[start:start + part.size])
        return result

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)
        for key in list(self._slots):
            try:
                self.client.release(self.dev, key)
            except Exception:  # noqa: BLE001 - the session may be gone already
                pass
        self._slots.clear()
        self._ffn.clear()


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
        self.sock.connect(f"tcp://{address}")
        self._ids = itertools.count(1)

    def request(self, layer: int, expert: int, rows: np.ndarray) -> int:
        """Send one REQUEST (``rows``: ``uint16[n, hidden]``); returns its message id."""
        mid = next(self._ids)
        rows = np.ascontiguousarray(rows)
        self.sock.send_multipart([frames.pack(
            Kind.REQUEST, mid, self.model, layer, expert, rows.shape[0],
            rows.shape[1] * rows.itemsize, rows.nbytes), rows], copy=False)
        return mid

    def receive(self) -> tuple[int, np.ndarray]:
        """The next answer: (message id, output rows ``uint16[n, hidden]``)."""
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError(f"no answer from the agent in {self.timeout_ms} ms")
        header, payload = self.sock.recv_multipart(copy=False)
        h = frames.unpack(header.bytes, len(payload.buffer))
        if int(h["kind"]) != Kind.RESPONSE:
            raise ActivationError(FrameStatus(int(h["status"])),
                                  payload.bytes.decode(errors="replace"))
        out = np.frombuffer(payload.buffer, np.uint16).reshape(int(h["rows"]), -1)
        return int(h["message_id"]), out

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
        plan = dispatch_plan(np, np.asarray(topk_ids), self.experts)
        packed = reference.dispatch(hidden, plan)
        offsets = plan.offsets
        outputs = np.empty_like(packed)
        where: dict[int, tuple[int, int]] = {}
        todo = [e for e in range(self.experts) if offsets[e + 1] > offsets[e]]
        outstanding = 0
        while todo or outstanding:
            while todo and outstanding < self.credits:
                e = todo.pop(0)
                mid = self.request(layer, e, packed[offsets[e]:offsets[e + 1]])
                where[mid] = (int(offsets[e]), int(offsets[e + 1]))
                outstanding += 1
            mid, out = self.receive()
            lo, hi = where.pop(mid)
            outputs[lo:hi] = out
            outstanding -= 1
        return reference.combine_bf16(outputs, plan, np.asarray(topk_weights, np.float32))

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> ActivationSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
