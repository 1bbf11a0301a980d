"""The agent's start-up time and CPU seconds per GB scheduled as an aarch64 process under
qemu-aarch64 (user-mode emulation) beside the native x86 figures, measured in the same run.
Start-up is measured twice: cold, with an empty Numba cache (the first start after an install,
which compiles the agent's loops before it reports ready), and warm, from that cache.
Emulation is slower than a BlueField's Cortex-A78 cores, so the aarch64 figures are a rough
upper bound, not a prediction.

Usage: python bench/arm64.py [--json]   (after scripts/arm64_env.sh)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuSnapshot, envelope, write
from dpu_offload.cli_args import positive
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess
from tests.arm64.conftest import arm64_env, arm64_interpreter

EXPERTS = 16


def start(interpreter: list[str] | None, env: dict[str, str]) -> tuple[AgentProcess, float]:
    """An agent started with ``env``; the seconds until it answered."""
    t0 = time.perf_counter()
    agent = AgentProcess('[arena]\nbytes = "512MiB"\n', env=env, interpreter=interpreter,
                         startup_timeout=600).start()
    return agent, time.perf_counter() - t0


def schedule(agent: AgentProcess, root: Path, cycles: int) -> tuple[float, float]:
    """Cycles of acquiring and releasing half the experts through ``agent`` (then stopped): the
    agent's CPU seconds over them and the GB they scheduled."""
    try:
        with AgentClient(agent.address, rpc_timeout=300) as client:
            model = client.load_model(str(root), "m")
            dev = client.register_device(CpuReferenceDevice(),
                                         [SlotPoolSpec(model.expert_bytes, EXPERTS // 2)])
            keys = [ExpertKey("m", 0, e) for e in range(EXPERTS)]
            halves = [keys[:EXPERTS // 2], keys[EXPERTS // 2:]]

            def cycle(batch: list[ExpertKey]) -> None:
                for h in client.acquire_batch(dev, batch):
                    h.wait(300)
                for k in batch:
                    client.release(dev, k)

            for half in halves:  # fills the arena; afterwards every cycle is arena -> slots
                cycle(half)
            cpu0 = CpuSnapshot.take(agent.proc.pid)
            for i in range(cycles):
                cycle(halves[i % 2])
            cpu = CpuSnapshot.take(agent.proc.pid).total_since(cpu0)
            gb = cycles * len(halves[0]) * model.expert_bytes / 1e9
    finally:
        agent.stop(timeout=60)
    return cpu, gb


def measure(root: Path, interpreter: list[str] | None, env: dict[str, str],
            cycles: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-arm64-numba-") as cache:
        env = {**env, "NUMBA_CACHE_DIR": cache}
        agent, cold = start(interpreter, env)
        agent.stop(timeout=60)
        agent, startup = start(interpreter, env)
        cpu, gb = schedule(agent, root, cycles)
    return {"startup_cold_s": cold, "startup_s": startup, "agent_cpu_s_per_gb": cpu / gb,
            "gb_scheduled": gb}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cycles", type=positive, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-arm64-") as tmp:
        root = make_checkpoint(Path(tmp) / "m", CheckpointSpec(
            "qwen3-moe", layers=1, experts=EXPERTS, hidden=2048, intermediate=768))
        native = measure(root, None, {}, args.cycles)
        emulated = measure(root, arm64_interpreter(), arm64_env(), args.cycles)
    result = {"native_x86_64": native, "aarch64_under_qemu": emulated,
              "startup_ratio": emulated["startup_s"] / native["startup_s"],
              "cold_startup_ratio": emulated["startup_cold_s"] / native["startup_cold_s"],
              "cpu_per_gb_ratio": emulated["agent_cpu_s_per_gb"] / native["agent_cpu_s_per_gb"]}
    print(f"start-up cold / warm: native {native['startup_cold_s']:.2f} / "
          f"{native['startup_s']:.2f} s, aarch64/qemu {emulated['startup_cold_s']:.2f} / "
          f"{emulated['startup_s']:.2f} s; agent CPU per GB scheduled: native "
          f"{native['agent_cpu_s_per_gb']:.3f} s, aarch64/qemu "
          f"{emulated['agent_cpu_s_per_gb']:.3f} s", file=sys.stderr)
    path = write("arm64", envelope("arm64", result, command="python bench/arm64.py"))
    print(json.dumps(result) if args.json else f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
