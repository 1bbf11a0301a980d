"""The activation path on a GPU: the worker's thread driving the packet kernels and the FFN,
its own stream (not held by the legacy stream's waits), the resident receiver (a persistent
kernel, no host thread per message), and a device going from one to the other and back."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from gpu_kernels import reference
from gpu_kernels.packet_ops import CudaPacketOps
from host_client import AgentClient, SlotPoolSpec
from host_client.activations import ActivationSender
from host_client.launcher import AgentProcess
from host_client.worker import ExpertWorker
from tests.activation_serving import SETTINGS, dispatch_matches_dense, routing
from tests.conftest import checkpoint_bytes


@contextlib.contextmanager
def cuda_serving(ckpt: Path, name: str, resident: bool):
    """An agent with every expert placed on GPU 0, served by a worker with or without the
    resident receiver: (agent's activation address, model, worker)."""
    pytest.importorskip("cupy")
    from host_client.cuda_device import CudaDevice

    # A fresh GPU machine compiles the FFN's CuPy kernels on the first request (seconds).
    with AgentProcess(SETTINGS + "worker_timeout_seconds = 60\n") as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(ckpt), name)
        dev = client.register_device(CudaDevice(0, mechanism="copy_engine"),
                                     [SlotPoolSpec(model.expert_bytes, 18)])
        client.wait_placement(client.apply_placement(name, [
            [[dev.device_id]] * model.experts_per_layer for _ in model.moe_layers]).placement_id)
        worker = ExpertWorker(client, dev, resident=resident)
        try:
            yield f"127.0.0.1:{agent.activations_port}", model, worker
        finally:
            worker.close()


@pytest.mark.gpu
def test_cuda_worker_kernels_match_dense_reference(qwen_ckpt: Path) -> None:
    """The same path on the GPU with the worker's thread driving the packet-receive and send
    kernels and the FFN (``resident=False``: the path of layouts the resident kernel does not
    compute)."""
    with cuda_serving(qwen_ckpt, "qg", resident=False) as (address, model, worker):
        dispatch_matches_dense(address, "qg", model.experts_per_layer, model.moe_layers[0],
                               qwen_ckpt, routing(model.experts_per_layer, 40, 2, seed=4),
                               seed=4)
        assert isinstance(worker.packets, CudaPacketOps) and worker.resident is None
        assert worker.refused_packets == 0


@pytest.mark.gpu
def test_the_worker_thread_is_not_held_by_the_legacy_stream(qwen_ckpt: Path) -> None:
    """The worker's thread computes on a stream of its own: with the legacy default stream
    held by a wait on a word nobody has written (as inference code's stream waits on slots
    hold it), a dispatch is still answered, and only then is the wait let go."""
    cp = pytest.importorskip("cupy")
    import cupyx

    from dpu_offload import abi
    from dpu_offload.channel import state_word
    from gpu_kernels import cuda_ops

    with cuda_serving(qwen_ckpt, "ql", resident=False) as (address, model, worker):
        layer, experts = model.moe_layers[0], model.experts_per_layer
        # The same dispatch once before loads the FFN's modules and fills the worker's memory
        # pool with its messages' sizes (a module load waits for a busy device); the release's
        # pinned buffer and stream are made before the wait too.
        dispatch_matches_dense(address, "ql", experts, layer, qwen_ckpt,
                               routing(experts, 40, 2, seed=9), seed=9)
        word, result = cp.zeros(1, cp.uint64), cp.full(1, 99, cp.uint32)
        ready = cupyx.empty_pinned(1, np.uint64)
        ready[0] = state_word(1, abi.SlotState.READY)
        side = cp.cuda.Stream(non_blocking=True)
        legacy = cp.cuda.Stream.null
        legacy.synchronize()
        cuda_ops.wait_ready(word.data.ptr, 1, 60.0, result, legacy)
        try:
            dispatch_matches_dense(address, "ql", experts, layer, qwen_ckpt,
                                   routing(experts, 40, 2, seed=9), seed=9)
            assert not legacy.done  # the dispatch did not wait for the legacy stream
            # Messages of sizes the worker's memory pool has not seen: new device allocations.
            dispatch_matches_dense(address, "ql", experts, layer, qwen_ckpt,
                                   routing(experts, 57, 2, seed=10), seed=10)
            assert not legacy.done, "a message of a new size waited for the legacy stream"
        finally:
            word.set(ready, stream=side)
            side.synchronize()
            legacy.synchronize()
        assert int(result.get()[0]) == 0  # READY: let go by the write, not timed out
        assert worker.resident is None


@pytest.mark.gpu
def test_the_resident_receiver_serves_without_a_host_thread(qwen_ckpt: Path) -> None:
    """The persistent kernel (gpu_kernels/serve.cu) serves the path alone: a dispatch matches
    the dense reference, a message larger than the rx ring (in parts) equals the NumPy FFN of
    the slot's weights, and its counters say so; the receiver's thread only watches."""
    with cuda_serving(qwen_ckpt, "qr", resident=True) as (address, model, worker):
        ids = routing(model.experts_per_layer, 40, 2, seed=6)
        sent = dispatch_matches_dense(address, "qr", model.experts_per_layer,
                                      model.moe_layers[0], qwen_ckpt, ids, seed=6)
        layer = model.moe_layers[1]
        rows = reference.f32_to_bf16(np.random.default_rng(7).standard_normal(
            (9000, 256), dtype=np.float32))  # 4.6 MB: parts of 2 MiB, more than the ring
        with ActivationSender(address, "qr", model.experts_per_layer) as sender:
            sender.request(layer, 2, rows)
            _, got = sender.receive()
        truth = checkpoint_bytes(qwen_ckpt)
        names = [f"model.layers.{layer}.mlp.experts.2.{r}.weight"
                 for r in ("gate_proj", "up_proj", "down_proj")]
        weights = [np.frombuffer(truth[n], np.uint16) for n in names]
        want = reference.swiglu_bf16(rows, weights[0].reshape(-1, 256),
                                     weights[1].reshape(-1, 256), weights[2].reshape(256, -1))
        diff = np.abs(reference.bf16_to_f32(got) - reference.bf16_to_f32(want)).max()
        assert diff <= 2 ** -6 * max(1.0, float(np.abs(reference.bf16_to_f32(want)).max()))
        assert worker.resident.counters() == (sent + 1, 0, 0)


@pytest.mark.gpu
def test_a_device_goes_from_the_resident_receiver_to_the_thread_and_back(qwen_ckpt: Path
                                                                        ) -> None:
    """The resident kernel consumes the rx ring and fills the tx ring on the GPU; once it
    stops, the worker's thread (and then a new kernel) goes on from the positions it reached:
    every dispatch in the sequence matches the dense reference."""
    with cuda_serving(qwen_ckpt, "qs", resident=True) as (address, model, worker):
        client, dev = worker.client, worker.dev
        for step, resident in enumerate((True, False, True)):
            if step:
                worker.close()
                worker = ExpertWorker(client, dev, resident=resident)
            assert (worker.resident is not None) == resident
            assert dev.tx.ring.doorbell == (not resident)  # the kernel rings no doorbell
            dispatch_matches_dense(address, "qs", model.experts_per_layer,
                                   model.moe_layers[0], qwen_ckpt,
                                   routing(model.experts_per_layer, 24, 2, seed=step), step)
        worker.close()
