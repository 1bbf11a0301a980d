"""The main job, end to end: a real-format checkpoint, the agent as its own process, the host
client with the GPU (persistent receive kernel) or the CPU reference device, every expert of
several layers acquired and verified byte for byte against the checkpoint files.

Exits non-zero if any byte does not verify.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dpu_offload.cli_args import positive
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, Device, SlotPoolSpec
from host_client.checkpoints import (
    CheckpointSpec,
    expert_tensor_names,
    make_checkpoint,
    read_tensor_bytes,
)
from host_client.launcher import AgentProcess


def pick_device(kind: str) -> Device:
    if kind in ("auto", "cuda"):
        try:
            from gpu_kernels.launch import cp  # CuPy, its kernel cache where this user may write

            if cp.cuda.runtime.getDeviceCount() > 0:
                from host_client.cuda_device import CudaDevice

                return CudaDevice(0)
        except Exception as exc:
            if kind == "cuda":
                raise SystemExit(f"demo: --device cuda but CUDA is not usable: {exc}") from exc
    return CpuReferenceDevice()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="qwen3-moe", choices=("qwen3-moe", "mixtral"))
    ap.add_argument("--layers", type=positive, default=4)
    ap.add_argument("--experts", type=positive, default=16)
    ap.add_argument("--hidden", type=positive, default=1024)
    ap.add_argument("--intermediate", type=positive, default=768)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--delivery", choices=("engine", "pull"), default="engine",
                    help="engine: the agent's DMA-engine process writes and checks the slots; "
                         "pull: the device's own consumer copies from the arena")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="dpu-demo-") as tmp:
        root = make_checkpoint(Path(tmp) / "model", CheckpointSpec(
            args.arch, layers=args.layers, experts=args.experts, hidden=args.hidden,
            intermediate=args.intermediate))
        truth = read_tensor_bytes(root)
        device = pick_device(args.device)
        with AgentProcess('[arena]\nbytes = "512MiB"\n') as agent:
            client = AgentClient(agent.address, client_name="demo")
            try:
                model = client.load_model(str(root), "demo")
                keys = [ExpertKey("demo", layer, e) for layer in model.moe_layers
                        for e in range(model.experts_per_layer)]
                dev = client.register_device(
                    device, [SlotPoolSpec(model.expert_bytes, len(keys))],
                    delivery=args.delivery)
                start = time.perf_counter()
                handles = [client.acquire(dev, k) for k in keys]
                slots = [h.wait(timeout=60) for h in handles]
                elapsed = time.perf_counter() - start
                bad = 0
                for slot in slots:
                    names = expert_tensor_names(args.arch, slot.key.layer, slot.key.expert)
                    for role, name in names.items():
                        got = slot.raw(role)
                        got = got.get() if hasattr(got, "get") else got
                        if np.asarray(got).tobytes() != truth[name]:
                            bad += 1
                            print(f"MISMATCH {slot.key} {role}", file=sys.stderr)
                nbytes = sum(s.manifest.blob_bytes for s in slots)
                for slot in slots:
                    client.release(dev, slot.key)
            finally:
                client.close()
    kind = "CUDA" if device.xp is not np else "CPU reference"
    kind += (", DMA-engine process" if args.delivery == "engine" else
             f", device pull ({getattr(device, 'mechanism', 'twin thread')})")
    print(f"device      {device.name} ({kind})")
    print(f"model       {model.architecture}, {len(model.moe_layers)} MoE layers x "
          f"{model.experts_per_layer} experts, {model.expert_bytes / 2**20:.2f} MiB/expert")
    print(f"verified    {len(slots) - bad}/{len(slots)} experts byte for byte")
    print(f"delivered   {nbytes / 2**20:.1f} MiB in {elapsed * 1e3:.1f} ms "
          f"({nbytes / elapsed / 1e9:.2f} GB/s, cold: checkpoint -> arena -> slots)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
