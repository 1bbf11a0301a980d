"""Serving activations (docs/ACTIVATIONS.md): :class:`ExpertWorker` serves the experts placed on
one registered device. The NIC stand-in (its own process, the agent's) writes each message
steered to the device into the device's rx packet ring, stamped with the expert's slot; on a
GPU the resident receiver (one persistent kernel, ``host_client.resident``) lands the rows with
their checksums verified, runs the expert's FFN on the weights in that slot and packetizes the
output into the tx ring, from which the NIC answers the sender; elsewhere this module's
receiver thread does the same (the kernel's twin on the CPU reference device). No byte of it
passes through the agent, and no RPC is made per message.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from prometheus_client import Counter
from threadpoolctl import ThreadpoolController

from dpu_offload import abi, futex, packets
from dpu_offload.frames import FrameStatus
from dpu_offload.keys import ExpertKey
from dpu_offload.v1 import agent_pb2 as pb
from gpu_kernels import gpt_oss, packet_twin, reference
from gpu_kernels.packet_ops import CudaPacketOps, HostPacketOps, PacketOps
from host_client.client import AgentClient
from host_client.memory import ExpertSlot
from host_client.registration import AttachedDevice

log = logging.getLogger("host_client.worker")
PACKETS_REFUSED = Counter("dpu_worker_packets_refused", "Activation packets that failed their "
                          "checksum in an expert worker's rx ring.", ["device"])
FFN_CACHE_EXPERTS = 512
"""Experts whose FFN (weights widened or made contiguous) a worker keeps ready."""
IDLE_SPIN_SECONDS = futex.SPARE_CORE_SPIN_SECONDS
"""After a message the receiver polls its rx ring this long before napping between polls (on
a machine with a core to spare: on a small one spinning starves the NIC), then sleeps on
the rx ring's doorbell (``dpu_offload.port_bell``, which the NIC rings after writing)."""
NAP_SECONDS = 50e-6
"""Nap between polls where the rx ring has no doorbell, and while waiting for tx room."""
BELL_WAIT_SECONDS = 0.05
"""The longest sleep on the doorbell (the loop then looks for a reconnection and a stop)."""
REASON_BYTES = 1024
"""An error answer's reason is cut to this many bytes."""
STOP_SECONDS = 5.0
"""The longest ``close`` waits for the agent to stop steering to the device (a worker told to
stop must stop: the agent also detaches the rings when the session ends or its lease lapses)."""


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


SMALL_BATCH_ROWS = 64
"""A CPU worker computes messages of fewer rows than this on one BLAS thread."""


def _one_blas_thread(ffn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``ffn`` computing a decode-sized message (fewer than ``SMALL_BATCH_ROWS`` rows) with one
    BLAS thread: the BLAS pool's other threads, which spin after each call, took the CPU the
    NIC stand-in needed (measured on the 2-core reference machine: 8 KiB round trip p50 1.26
    -> 0.98 ms). Larger messages keep the pool. The BLAS libraries' own setters are called
    (threadpoolctl's ``limit`` costs ~45 us a message in Python on that machine)."""
    blas = _blas_libraries()

    def limited(x: Any) -> Any:
        if x.shape[0] >= SMALL_BATCH_ROWS or not blas:
            return ffn(x)
        before = [lib.get_num_threads() for lib in blas]
        for lib in blas:
            lib.set_num_threads(1)
        try:
            return ffn(x)
        finally:
            for lib, n in zip(blas, before, strict=True):
                lib.set_num_threads(n)
    return limited


@functools.cache
def _blas_libraries() -> tuple[Any, ...]:
    """threadpoolctl's controllers of the BLAS libraries loaded in this process."""
    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


class ExpertWorker:
    """Serves the activations the NIC steers to ``dev`` (``ServeActivations``). On a CUDA
    device whose loaded models the resident receiver computes (``resident=None`` chooses it
    then; ``True`` insists), one persistent kernel receives, computes and answers
    (host_client.resident); otherwise this object's thread drives the packet-receive and send
    kernels and the FFN per message (on the CPU reference device: their NumPy twins and
    NumPy, the twin of the resident kernel).

    Attributes:
        served: messages answered with output rows.
        failed: messages answered with an error (an expert it cannot compute, rows that
            failed their check).
            Both count a message before its answer is published, so a sender holding an
            answer finds it counted.
        refused_packets: rx packets that failed their checksum (also
            ``dpu_worker_packets_refused_total``); the NIC writes their message again.
    """

    def __init__(self, client: AgentClient, dev: AttachedDevice, resident: bool | None = None
                 ) -> None:
        if not client.activations_port:
            raise ValueError("the agent has no [activations] listen_address")
        cuda = dev.device.kind == pb.DEVICE_KIND_CUDA
        if resident and not cuda:
            raise ValueError("the resident receiver runs on a CUDA device")
        self.client, self.dev = client, dev
        self.served = self.failed = self.refused_packets = 0
        self.resident: Any = None
        """The resident receiver (``resident=True``: host_client.resident) while it runs."""
        self._want_resident = resident if resident is not None else cuda and all(
            self._resident_computes(m.model) for m in client.status().models)
        self.xp: Any = np
        """The array module of the device's buffers (CuPy on a CUDA device)."""
        self.packets: PacketOps = HostPacketOps()
        if cuda:
            import cupy

            self.xp = cupy
            self.packets = CudaPacketOps(dev.rx_device_ptr, dev.tx_device_ptr)
        self._ffn: OrderedDict[tuple[ExpertKey, int, int],
                               tuple[Callable[[Any], Any], int]] = OrderedDict()
        """(expert, region id, slot offset) -> its FFN, rows (bf16 bits ``uint16[rows,
        hidden]``) -> rows, weights ready, and ``hidden``."""
        self._inputs: dict[int, tuple[Any, int]] = {}
        """Message id -> (its rows' buffer, bytes landed so far)."""
        self._models: dict[int, str] = {}
        self._generation = -1
        if not self._want_resident:  # this thread polls the rings through the host loops
            packet_twin.warm_up()
        self._serve()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="expert-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Ask the agent to have the NIC steer to this device (again after a reconnection,
        whose device has fresh rings)."""
        self._generation = self.client.generation
        self.client.stub.ServeActivations(pb.ServeActivationsRequest(
            session_id=self.client.session_id, device_id=self.dev.device_id, serve=True),
            timeout=self.client.rpc_timeout)
        self._models = {m.model_index: m.model for m in self.client.status().models}
        self._ffn.clear()
        self._inputs.clear()
        self._announce_doorbell(not self._want_resident)
        if self._want_resident:
            from host_client.resident import ResidentReceiver

            if self.resident is not None:
                self.resident.stop()
            manifests = {i: self.client.model_manifest(name) for i, name in self._models.items()}
            self.resident = ResidentReceiver(self.dev, {i: m for i, m in manifests.items()
                                                        if m is not None})

    def _announce_doorbell(self, rings: bool) -> None:
        """Say in the tx ring's header whether its producer (this thread, not the resident
        kernel) rings the tx doorbell after publishing, so the NIC may sleep on it; then ring
        it, so a NIC asleep on the old promise looks again."""
        tx = self.dev.tx
        tx.ring.doorbell = rings and tx.bell is not None
        if tx.bell is not None:
            tx.bell.ring()

    def _resident_computes(self, model: str) -> bool:
        """Whether the resident kernel computes ``model``'s experts (its layout)."""
        from host_client.serve_tables import model_entry

        manifest = self.client.model_manifest(model)
        return manifest is not None and bool(model_entry(manifest)["kind"])

    def _loop(self) -> None:
        with contextlib.ExitStack() as scope:
            if self.xp is not np:
                # The device's, on a stream of its own: on the legacy default stream its
                # kernels and copies would queue behind the inference code's work there,
                # stream waits on slots included.
                scope.enter_context(self.xp.cuda.Device(self.dev.device.ordinal))
                scope.enter_context(self.xp.cuda.Stream(non_blocking=True))
            self._poll()

    def _poll(self) -> None:
        last = time.monotonic()
        futex.tight_timer_slack("expert-worker")
        # Rows are the senders': NaN or huge bf16 values give NaN or inf out, as on a GPU,
        # with no warning per message (NumPy's error state is this thread's own).
        np.seterr(over="ignore", invalid="ignore")
        while not self._stop.is_set():
            if self.client.generation != self._generation:
                try:
                    self._serve()
                except Exception:  # noqa: BLE001 - the agent may still be coming back
                    time.sleep(0.1)
                    continue
            if self.resident is not None:  # the kernel serves: only watch for a reconnection
                self.served, self.failed, self.refused_packets = self.resident.counters()
                self._stop.wait(0.05)
                continue
            h = packet_twin.peek_packet(self.dev.rx.ring)
            if h is not None and self._take(h):
                last = time.monotonic()
                continue
            # Spinning still lets the process's other threads have the GIL (sleep(0) drops
            # it): a thread that only polls would hold it for the whole switch interval.
            if time.monotonic() - last < IDLE_SPIN_SECONDS:
                time.sleep(0)
            elif self.dev.rx.bell is not None:
                self.dev.rx.bell.wait(BELL_WAIT_SECONDS)
            else:
                time.sleep(NAP_SECONDS)

    def _take(self, h: packets.PacketHeader) -> bool:
        """Land the next part on the rx ring; answer its message once whole. False when the
        part is not all there yet."""
        nid, total = h.message_id, h.total_length
        state = self._inputs.get(nid)
        if state is None:
            if h.offset != 0:  # a part of a message already answered (failed)
                return self._land(self.xp.zeros(0, np.uint8)) is not None
            state = (self.xp.zeros(total, np.uint8), 0)
        landed = self._land(state[0])
        if landed is None:
            return False
        written, refused, (first, end, whole) = landed
        # The part must land all of [bytes so far, end), and end the message or a whole packet
        # (a packet cut short, checksum and all, would leave a hole otherwise).
        if refused or first != state[1] or written != end - first or not (whole or end == total):
            self._inputs.pop(nid, None)
            self.refused_packets += refused
            PACKETS_REFUSED.labels(str(self.dev.device_id)).inc(refused)
            self._error(h, FrameStatus.BAD_CHECKSUM,
                        f"{refused} packets failed their checksum and {written} of "
                        f"{end - first} bytes landed from offset {first}")
            return True
        buf, done = state[0], state[1] + written
        if done < total:
            self._inputs[nid] = (buf, done)
            return True
        self._inputs.pop(nid, None)
        self._answer(h, buf)
        return True

    def _land(self, dst: Any) -> tuple[int, int, tuple[int, int, bool]] | None:
        """Receive the next part into ``dst``: (bytes written, packets refused, (its first
        packet's offset, its last packet's end, whether that packet is full)), or None if it
        is not all published yet."""
        rx = self.dev.rx.ring
        assert rx.payload is not None
        count = packet_twin.part_packets(rx)
        if count is None:
            return None
        head = packet_twin.packet_at(rx, rx.consumed)
        tail = packet_twin.packet_at(rx, rx.consumed + count - 1)
        span = (head.offset, tail.offset + tail.length,
                tail.length == rx.payload.shape[1])
        written, refused = self.packets.receive(rx, dst, count)
        return written, refused, span

    def _answer(self, h: packets.PacketHeader, buf: Any) -> None:
        nid = h.message_id
        try:
            key = ExpertKey(self._model(h.model), h.layer, h.expert)
            region, offset = packets.unpack_slot(h.slot)
            ffn, hidden = self._ffn_of(key, region, offset)
            if buf.size % (2 * hidden):
                raise ValueError(f"{buf.size} bytes are not rows of {key}'s {hidden} values")
            out = ffn(buf.view(np.uint16).reshape(-1, hidden)).view(np.uint8).reshape(-1)
        except (ValueError, KeyError, IndexError) as exc:
            self._error(h, FrameStatus.WORKER_FAILED, f"{type(exc).__name__}: {exc}")
            return
        self.served += 1
        self._send(out, nid, h)

    def _model(self, index: int) -> str:
        name = self._models.get(index)
        if name is None:  # a model loaded after this worker started
            self._models = {m.model_index: m.model for m in self.client.status().models}
            name = self._models.get(index)
        if name is None:
            raise KeyError(f"model index {index} is not loaded")
        return name

    def _ffn_of(self, key: ExpertKey, region: int, offset: int
                ) -> tuple[Callable[[Any], Any], int]:
        """The FFN of ``key`` in the slot at (region, offset), weights ready, and the hidden
        size it takes (kept for the ``FFN_CACHE_EXPERTS`` experts used last). SwiGLU: widened
        to float32 and laid out for ``rows @ weight`` on the CPU (NumPy has no BF16 GEMM),
        C-contiguous on a GPU for the fused kernel. Clamped SwiGLU (gpt-oss, BF16 or MXFP4):
        weights and biases widened to float32 on either, laid out likewise (the array formula,
        cuBLAS on a GPU). ValueError for an expert the worker cannot compute."""
        where = (key, region, offset)
        got = self._ffn.get(where)
        if got is not None:
            self._ffn.move_to_end(where)
            return got
        manifest = self.client.manifest(key)
        slot = ExpertSlot(key, self.dev.device.region_bytes(region, offset,
                                                            manifest.blob_bytes), manifest)
        if manifest.activation == pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU:
            w = slot.clamped_swiglu_weights()
            arrays = [self.xp.ascontiguousarray(a) for a in
                      (w.gate.T, w.up.T, w.down.T, w.gate_bias, w.up_bias, w.down_bias)]
            ffn = lambda x: gpt_oss.clamped_swiglu_f32_weights(  # noqa: E731
                x, *arrays, w.alpha, w.limit)
            hidden = int(w.down.shape[0])
        else:
            weights = slot.swiglu_weights()
            hidden = int(weights[2].shape[0])
            if self.xp is np:
                wide = reference.widen_swiglu(*weights)
                ffn = lambda x: reference.swiglu_wide(x, wide)  # noqa: E731
            else:
                kept = [self.xp.ascontiguousarray(w) for w in weights]
                ffn = lambda x: expert_ffn(x, *kept)  # noqa: E731
        if self.xp is np:
            ffn = _one_blas_thread(ffn)
        self._ffn[where] = (ffn, hidden)
        if len(self._ffn) > FFN_CACHE_EXPERTS:
            self._ffn.popitem(last=False)
        return ffn, hidden

    def _send(self, out: Any, nid: int, h: packets.PacketHeader, status: int = 0, flags: int = 0
              ) -> None:
        """Packetize ``out`` (uint8) into the tx ring in parts of ``packets.part_limit`` packets,
        each once the NIC has made room for it."""
        tx = self.dev.tx.ring
        fields = (nid, h.model, h.layer, h.expert)
        step = packets.packet_room(tx.entry_size) * packets.part_limit(tx.capacity)
        for base in range(0, max(1, out.size), step):
            part = out[base:base + step]
            while tx.free_entries() < packets.packet_count(part.size, tx.entry_size):
                if self._stop.wait(NAP_SECONDS):
                    return
            self.packets.send(tx, part, *fields, base=base, total=out.size, status=status,
                              flags=flags)
            if self.dev.tx.bell is not None:
                self.dev.tx.bell.ring()

    def _error(self, h: packets.PacketHeader, status: FrameStatus, reason: str) -> None:
        self.failed += 1
        self._send(packets.error_payload(reason, REASON_BYTES), h.message_id, h,
                   int(status), abi.PacketFlags.ERROR)

    def close(self) -> None:
        self._stop.set()
        if self.dev.rx.bell is not None:
            self.dev.rx.bell.ring()
        self._thread.join(2)
        self._announce_doorbell(False)
        if self.resident is not None:
            self.served, self.failed, self.refused_packets = self.resident.counters()
            self.resident.stop()
            self.resident = None
        try:
            self.client.stub.ServeActivations(pb.ServeActivationsRequest(
                session_id=self.client.session_id, device_id=self.dev.device_id,
                serve=False), timeout=min(self.client.rpc_timeout, STOP_SECONDS))
        except grpc.RpcError as exc:  # the session may be gone already: the NIC detaches then
            log.warning("device %d: the NIC was not told to stop serving it: %s %s",
                        self.dev.device_id, exc.code(), exc.details())
        except ValueError:  # the client's channel is closed: so is its session
            pass
        self._ffn.clear()
        self._inputs.clear()
