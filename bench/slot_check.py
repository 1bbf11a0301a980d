"""The slot check's pace on a GPU: how soon after the DMA engine's LANDED word a slot reads
READY, the part of an acquire's latency that runs in the inference process's own kernel
(``dpu_verify_granted_batch`` in gpu_kernels/ready.cu, launched when the ACQUIREs are posted).

For slots of 4.7 / 9.4 / 44 MB, one slot and a batch of eight, in each form of launching it
(``cuda_ops.verify_granted_batch``): ``resident-B`` for each ``--blocks`` B (B blocks per slot
resident from the launch, each slot summed by them as it lands; the client's form with
``RESIDENT_BLOCKS_PER_SLOT``), ``batch`` (a small block per slot waits, then the whole GPU sums
the batch) and ``slot`` (the same per slot, in order), two figures:
- ``landed_to_ready_us``: the check is launched against FILLING slots and left waiting
  (``--idle-ms``, as it waits for the copies); the host then writes LANDED into the mapped
  slot-state words and spins until every slot reads READY; wall time from the store to the
  last READY, p50 over ``--repeats``. This is what a client that never sleeps sees.
- ``sum_us``: the same kernel launched on slots already LANDED, between CUDA events: the sum
  and verdict alone.
Baseline in the same run: ``cupy.sum`` over the same bytes as uint32 (``reduce_us``), the
device's plain read rate through a library reduction. Every check must publish READY (the
slots hold bytes whose expected sum is right); any other outcome fails the run.

Usage: python bench/slot_check.py [--blocks 8 64] [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, median, pct, write
from dpu_offload import abi
from dpu_offload.channel import Channel, state_word
from dpu_offload.checksum import terms_sum

SHAPES = {"small-4.7MB": 4_718_592, "qwen3-30b-a3b-9.4MB": 9_437_184,
          "deepseek-v3-44MB": 44_040_192}
"""Slot bytes per shape (the experts of bench/delivery.py)."""
BATCH = 8
GENERATION = 5
REGION = 1


class Bench:
    """A mapped channel whose first ``BATCH`` replies grant slots of one pool on the GPU, each
    holding the same random blob (a blob's sum does not depend on where its slot is)."""

    def __init__(self, cp: Any, nbytes: int, seed: int) -> None:
        from gpu_kernels import cuda_ops
        from host_client.cuda_device import device_pointer

        self.cp, self.nbytes = cp, nbytes
        blob = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.expected = terms_sum(blob)
        self.pool = cp.asarray(np.tile(blob, BATCH))
        self.channel = Channel.format(np.zeros(abi.channel_layout(64).total, np.uint8), 64)
        self.params = np.zeros(BATCH, abi.CHECK_DTYPE)
        rt = cp.cuda.runtime
        for host in (self.channel.buffer, self.params):
            rt.hostRegister(host.ctypes.data, host.nbytes, 0x1 | 0x2)  # portable | mapped
        regions = np.zeros(abi.MAX_REGIONS, abi.REGION_DTYPE)
        regions[REGION] = (int(self.pool.data.ptr), self.pool.size, abi.RegionFlags.WRITABLE, 0)
        self.regions = cp.asarray(regions.view(np.uint8))
        for i in range(BATCH):
            self.channel.reply(i, i + 1, abi.RequestStatus.OK, region_id=REGION, slot_index=i,
                               state_index=i, generation=GENERATION, slot_offset=i * nbytes)
        at = device_pointer(self.channel.buffer.ctypes.data)
        layout = abi.channel_layout(self.channel.capacity)
        self.params["reply"] = [at + layout.replies + i * abi.REPLY_DTYPE.itemsize
                                for i in range(BATCH)]
        self.params["seq"] = np.arange(1, BATCH + 1)
        self.params["states"] = at + layout.states
        self.params["n16"] = nbytes // 16
        self.params_at = device_pointer(self.params.ctypes.data)
        self.results = cp.zeros(BATCH, cp.uint32)
        self.scratch = cp.zeros(cuda_ops.CHECK_SCRATCH_WORDS * BATCH, cp.uint32)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.words = self.channel.states["word"]

    def close(self) -> None:
        rt = self.cp.cuda.runtime
        for host in (self.params, self.channel.buffer):
            rt.hostUnregister(host.ctypes.data)

    def _arm(self, n: int, state: abi.SlotState) -> None:
        for i in range(n):
            self.channel.states[i] = (state_word(GENERATION, state), 0, self.expected)
        self.results.fill(0xFFFFFFFF)
        self.cp.cuda.Device().synchronize()

    def _launch(self, n: int, form: tuple[str, int]) -> None:
        from gpu_kernels import cuda_ops

        cuda_ops.verify_granted_batch(self.params_at, n, self.nbytes // 16, self.regions, 5.0,
                                      self.results, self.scratch, self.stream, form=form[0],
                                      resident_blocks=form[1])

    def _verdicts(self, n: int) -> None:
        got = self.results[:n].get().tolist()
        if got != [0] * n:
            raise SystemExit(f"slot_check: outcomes {got}, expected READY (0) for every slot")

    def landed_to_ready(self, n: int, form: tuple[str, int], idle_s: float) -> float:
        """Seconds from the host's LANDED stores to the last slot reading READY."""
        self._arm(n, abi.SlotState.FILLING)
        self._launch(n, form)
        time.sleep(idle_s)
        landed = state_word(GENERATION, abi.SlotState.LANDED)
        ready = state_word(GENERATION, abi.SlotState.READY)
        start = time.perf_counter()
        for i in range(n):
            self.words[i] = landed
        for i in range(n):
            while int(self.words[i]) != ready:
                if time.perf_counter() - start > 5.0:
                    raise SystemExit(f"slot_check: slot {i} never read READY")
        took = time.perf_counter() - start
        self.stream.synchronize()
        self._verdicts(n)
        return took

    def sum_time(self, n: int, form: tuple[str, int]) -> float:
        """Seconds of the check on slots already LANDED, between CUDA events."""
        self._arm(n, abi.SlotState.LANDED)
        a, b = self.cp.cuda.Event(), self.cp.cuda.Event()
        a.record(self.stream)
        self._launch(n, form)
        b.record(self.stream)
        b.synchronize()
        self._verdicts(n)
        return self.cp.cuda.get_elapsed_time(a, b) / 1e3

    def reduce_time(self, n: int) -> float:
        """Seconds of ``cupy.sum`` over ``n`` slots' bytes as uint32, between CUDA events."""
        words = self.pool[:n * self.nbytes].view(self.cp.uint32)
        with self.stream:
            a, b = self.cp.cuda.Event(), self.cp.cuda.Event()
            a.record(self.stream)
            words.sum(dtype=self.cp.uint64)
            b.record(self.stream)
            b.synchronize()
        return self.cp.cuda.get_elapsed_time(a, b) / 1e3


def modes(blocks: list[int]) -> list[tuple[str, tuple[str, int]]]:
    """(name, (``form``, ``resident_blocks``)) of each way of launching the check measured."""
    return [*((f"resident-{b}", ("resident", b)) for b in blocks), ("batch", ("batch", 0)),
            ("slot", ("slot", 0))]


def measure(cp: Any, shape: str, blocks: list[int], repeats: int, idle_s: float
            ) -> dict[str, Any]:
    bench = Bench(cp, SHAPES[shape], seed=len(shape))
    try:
        out: dict[str, Any] = {"bytes": bench.nbytes}
        for n in (1, BATCH):
            bench.reduce_time(n)  # warm
            row: dict[str, Any] = {
                "reduce_us": median([bench.reduce_time(n) for _ in range(repeats)]) * 1e6}
            for mode, form in modes(blocks):
                bench.sum_time(n, form)
                sums = [bench.sum_time(n, form) for _ in range(repeats)]
                ready = [bench.landed_to_ready(n, form, idle_s) for _ in range(repeats)]
                row[mode] = {"sum_us": median(sums) * 1e6,
                             "landed_to_ready_us": median(ready) * 1e6,
                             "landed_to_ready_p90_us": pct(ready, 90) * 1e6}
            out[f"slots_{n}"] = row
        return out
    finally:
        bench.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda"], default="cuda",
                    help="the check is a CUDA kernel (its twin's pace is the CPU's)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 64],
                    help="blocks per slot of each resident-B launch measured (1-1024)")
    ap.add_argument("--repeats", type=int, default=15, help="trials per figure (1-1000)")
    ap.add_argument("--idle-ms", type=float, default=2.0,
                    help="how long the launched check waits before LANDED is written (0-100)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not all(1 <= b <= 1024 for b in args.blocks):
        ap.error("--blocks: each between 1 and 1024")
    if not 1 <= args.repeats <= 1000:
        ap.error("--repeats: between 1 and 1000")
    if not 0 <= args.idle_ms <= 100:
        ap.error("--idle-ms: between 0 and 100")
    from gpu_kernels import cuda_ops, launch

    cp = launch.cp
    launch.preload(cp.cuda.Device().id)
    results = {}
    for shape in SHAPES:
        r = results[shape] = measure(cp, shape, args.blocks, args.repeats, args.idle_ms / 1e3)
        for n in (1, BATCH):
            row = r[f"slots_{n}"]
            gb = n * r["bytes"] / 1e9
            cells = "  ".join(
                f"{mode}: ready {c['landed_to_ready_us']:5.0f} us, sum {c['sum_us']:5.0f} us "
                f"({gb / c['sum_us'] * 1e6:4.0f} GB/s)"
                for mode, c in ((m, row[m]) for m, _ in modes(args.blocks)))
            print(f"{shape:20s} x{n}  cupy.sum {row['reduce_us']:5.0f} us "
                  f"({gb / row['reduce_us'] * 1e6:5.0f} GB/s) | {cells}")
    data = envelope("slot_check", results, device="cuda", blocks=args.blocks,
                    command=" ".join(["python", "bench/slot_check.py", *sys.argv[1:]]),
                    repeats=args.repeats, idle_ms=args.idle_ms,
                    sum_blocks_per_sm=cuda_ops.SUM_BLOCKS_PER_SM)
    print(f"wrote {write('slot_check', data, '-cuda')}")
    if args.json:
        print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
