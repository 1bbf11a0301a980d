"""The resident receiver on a GPU (gpu_kernels/serve.cu): one persistent kernel consumes the
device's rx packet ring, checks every packet, runs each whole message's SwiGLU FFN on the
slot its packets name and answers on the tx ring, with no host thread per message
(docs/ACTIVATIONS.md). Its twin is the NumPy receiver of ``host_client.worker``.

It computes BF16 experts (``model_entry`` says which layouts); a message for any other (MXFP4,
FP8) is answered with an error, not computed: a worker whose models include one keeps the
host-thread path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpu_offload import abi
from dpu_offload.v1 import agent_pb2 as pb
from gpu_kernels import launch
from host_client.registration import AttachedDevice
from host_client.serve_tables import CTL_DTYPE, MODEL_DTYPE, REGION_DTYPE, model_entry

INPUT_BYTES = 8 << 20
"""The largest message the kernel takes (bytes of rows); a larger one is answered an error."""
BLOCKS, THREADS = 32, 256  # serve.cu's tiled products take 256 threads a block


class ResidentReceiver:
    """The persistent kernel serving ``dev``'s rings.

    Args:
        dev: a CUDA device registered with its rx / tx packet rings and slot pools.
        manifests: model index -> one expert's manifest of that model (every expert of a
            model shares the layout).
    """

    def __init__(self, dev: AttachedDevice, manifests: dict[int, pb.ExpertManifest]) -> None:
        cp = launch.cp
        self.dev = dev
        launch.preload(dev.device.ordinal)
        regions = np.zeros(abi.MAX_REGIONS, REGION_DTYPE)
        for rid, spec in dev.pools.items():
            size = spec.slot_bytes * spec.slot_count
            regions[rid] = (int(dev.device.region_bytes(rid, 0, size).data.ptr), size)
        models = np.zeros(max(manifests, default=-1) + 1, MODEL_DTYPE)
        for index, manifest in manifests.items():
            models[index] = model_entry(manifest)
        served = models[models["kind"] != 0]
        rows_max = [INPUT_BYTES // (2 * int(m["hidden"])) for m in served]
        h_floats = max([r * int(m["inter"]) for r, m in zip(rows_max, served, strict=True)],
                       default=8)
        with cp.cuda.Device(dev.device.ordinal):
            self.stream = launch.non_blocking_stream()
            self._reads = launch.non_blocking_stream()
            """Where the counters are read while the kernel holds ``stream``."""
            self._regions = cp.asarray(regions.view(np.uint8))
            self._models = cp.asarray(models.view(np.uint8)) if models.size else \
                cp.zeros(MODEL_DTYPE.itemsize, cp.uint8)
            self._input = cp.zeros(INPUT_BYTES, cp.uint8)
            self._hidden = cp.zeros(h_floats, cp.float32)
            self._output = cp.zeros(INPUT_BYTES, cp.uint8)
            self._reason = cp.zeros(64, cp.uint8)
            ctl = np.zeros(1, CTL_DTYPE)
            ctl["pos"], ctl["tx_pos"] = dev.rx.ring.consumed, dev.tx.ring.produced
            ctl["nid"] = ctl["answer"] = np.uint64(2**64 - 1)  # no message under way
            self._ctl = cp.asarray(ctl.view(np.uint8))
            rx, tx = dev.rx_device_ptr, dev.tx_device_ptr
            blocks = min(BLOCKS, launch.sm_count(dev.device.ordinal))
            launch.kernel("serve", "dpu_serve")(
                (blocks,), (THREADS,),
                (np.uint64(rx), np.uint64(rx + abi.HEADER_BYTES), np.uint64(tx),
                 np.uint64(tx + abi.HEADER_BYTES), self._regions, self._models,
                 np.uint32(models.size), self._input, np.uint64(INPUT_BYTES), self._hidden,
                 np.uint64(h_floats), self._output, self._reason, self._ctl),
                stream=self.stream)

    def counters(self) -> tuple[int, int, int]:
        """(messages answered with output, answered with an error, rx packets refused)."""
        ctl = self._ctl.get(stream=self._reads).view(CTL_DTYPE)[0]
        return int(ctl["served"]), int(ctl["failed"]), int(ctl["refused_packets"])

    def stop(self) -> None:
        """End the kernel (the rings' exit flags), wait for it, and take over the ring
        positions it reached, so that whatever serves the device next (the worker's thread, a
        new receiver) goes on from there."""
        rx, tx = self.dev.rx.ring, self.dev.tx.ring
        for ring in (rx, tx):
            ring.header["exit_flag"] = 1
        self.stream.synchronize()
        for ring in (rx, tx):
            ring.header["exit_flag"] = 0
        ctl = self._ctl.get(stream=self._reads).view(CTL_DTYPE)[0]
        rx.advance(int(ctl["pos"]) - rx.consumed)
        tx.advance_producer(int(ctl["tx_pos"]) - tx.produced)

    def __enter__(self) -> ResidentReceiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
