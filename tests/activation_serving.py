"""What the activation tests share: an agent serving a checkpoint's experts from a CPU
reference device's worker, and a dispatch checked against a float64 dense reference."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from gpu_kernels import reference
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationSender
from host_client.launcher import AgentProcess
from host_client.worker import ExpertWorker
from tests.conftest import checkpoint_bytes

SETTINGS = '[activations]\nlisten_address = "127.0.0.1:0"\ncredits_per_sender = 4\n'
METRICS = '[metrics]\nlisten_address = "127.0.0.1:0"\n'


@contextlib.contextmanager
def serving(ckpt: Path, worker_type: type[ExpertWorker] = ExpertWorker):
    """An agent with every expert of the checkpoint placed on the first of two CPU devices,
    served by a ``worker_type`` worker."""
    with AgentProcess(SETTINGS + METRICS) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(ckpt), "qa")
        devs = [client.register_device(CpuReferenceDevice(i),
                                       [SlotPoolSpec(model.expert_bytes, 18)]) for i in range(2)]
        pid = client.apply_placement("qa", [[[devs[0].device_id]] * model.experts_per_layer
                                            for _ in model.moe_layers]).placement_id
        client.wait_placement(pid)
        worker = worker_type(client, devs[0])
        try:
            yield agent, client, model, devs, worker
        finally:
            worker.close()


def dense(ckpt: Path, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The MoE layer in float64 from the checkpoint's own bytes (per-expert or fused):
    ``x`` (bf16 bits ``[tokens, hidden]``) routed by ``ids`` (``[tokens, k]``) with gate
    weights ``w`` (``[tokens, k]``); ``float64[tokens, hidden]``."""
    truth = checkpoint_bytes(ckpt)
    inter = json.loads((ckpt / "config.json").read_text())["moe_intermediate_size"]

    def weight(e: int, role: str) -> np.ndarray:
        name = f"model.layers.{layer}.mlp.experts.{e}.{role}.weight"
        if name in truth:
            raw = np.frombuffer(truth[name], np.uint16)
        else:  # saved fused: [E, 2I, H] (gate rows, then up rows) and [E, H, I]
            stacked = "down_proj" if role == "down_proj" else "gate_up_proj"
            rows = x.shape[1] if role == "down_proj" else 2 * inter
            cols = inter if role == "down_proj" else x.shape[1]
            raw = np.frombuffer(truth[f"model.layers.{layer}.mlp.experts.{stacked}"],
                                np.uint16).reshape(-1, rows, cols)[e]
            if role != "down_proj":
                raw = raw[:inter] if role == "gate_proj" else raw[inter:]
        return reference.bf16_to_f32(raw).astype(np.float64)

    xf = reference.bf16_to_f32(x).astype(np.float64)
    out = np.zeros_like(xf)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g = weight(e, "gate_proj").reshape(-1, x.shape[1]) @ xf[t]
            u = weight(e, "up_proj").reshape(-1, x.shape[1]) @ xf[t]
            h = g / (1 + np.exp(-g)) * u
            out[t] += w[t, k] * (weight(e, "down_proj").reshape(x.shape[1], -1) @ h)
    return out


def dispatch_matches_dense(address: str, name: str, experts: int, layer: int, ckpt: Path,
                           ids: np.ndarray, seed: int = 0) -> int:
    """Dispatch random rows routed by ``ids`` (int[tokens, k]) with random gate weights through
    the agent at ``address``, then the last half of them again through the same sender (its
    buffers reused, smaller); each combined output must match the float64 dense reference
    within bf16 rounding. Returns the messages sent (one per expert chosen, per dispatch)."""
    rng = np.random.default_rng(seed)
    x = reference.f32_to_bf16(rng.standard_normal((ids.shape[0], 256), dtype=np.float32))
    w = rng.random(ids.shape, dtype=np.float32)
    w /= w.sum(1, keepdims=True)
    sent = 0
    with ActivationSender(address, name, experts, credits=4) as sender:
        for first in (0, ids.shape[0] // 2):
            sent += len(np.unique(ids[first:]))
            got = sender.dispatch(layer, x[first:], ids[first:], w[first:])
            ref = dense(ckpt, layer, x[first:], ids[first:], w[first:])
            out = reference.bf16_to_f32(got).astype(np.float64)
            assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2
    return sent


def routing(experts: int, tokens: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])


def metrics(agent: AgentProcess) -> dict[tuple[str, tuple], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}
