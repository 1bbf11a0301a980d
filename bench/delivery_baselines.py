"""The delivery benchmark's baselines, measured in the same run as the delivery itself: plain
host-to-device copies of the same bytes (pinned, pageable, Expert Kit-style HTTP staging) and
the copy engine reading the agent's registered arena without rings."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.common import chunk_server, http_fetch, median


def copy_gbps(dst: int, src: int, nbytes: int, repeats: int) -> float:
    """GB/s of one cudaMemcpyAsync of ``nbytes`` from host address ``src`` (pinned or
    registered) to device address ``dst`` on a stream of its own: the median of ``repeats``
    after two warm-up copies."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(dst, src, nbytes, 1, stream.ptr)
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / median(times[2:]) / 1e9


def baselines(nbytes: int, repeats: int, gpu: bool) -> dict[str, float]:
    """GB/s of the host-to-device baselines for ``nbytes``: ``pinned_h2d`` and
    ``pageable_h2d`` on a GPU, ``http_staged`` on both devices."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    out: dict[str, float] = {}
    srv = chunk_server({"expert": data.tobytes()})
    xp = np
    if gpu:
        import cupy as cp

        xp = cp
        pinned_mem = cp.cuda.alloc_pinned_memory(nbytes)
        pinned = np.frombuffer(pinned_mem, np.uint8, nbytes)
        pinned[:] = data
        dst = cp.empty(nbytes, cp.uint8)
        out["pinned_h2d"] = copy_gbps(dst.data.ptr, pinned.ctypes.data, nbytes, repeats)
    if gpu:  # on the CPU reference device "device memory" is host memory: nothing to copy
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            arr = xp.asarray(data)
            xp.cuda.get_current_stream().synchronize()
            times.append(time.perf_counter() - t0)
            del arr
        out["pageable_h2d"] = nbytes / median(times[1:]) / 1e9
    times = []
    host = bytearray(nbytes)
    for _ in range(max(1, repeats // 2)):
        t0 = time.perf_counter()
        host = http_fetch(srv, "expert", nbytes)
        staged = xp.asarray(np.frombuffer(host, np.uint8))
        if gpu:
            xp.cuda.get_current_stream().synchronize()
        times.append(time.perf_counter() - t0)
        del staged
    out["http_staged"] = nbytes / median(times) / 1e9
    srv.shutdown()
    return out


def copy_engine_from_arena(device: Any, arena_region: int, nbytes: int,
                           repeats: int) -> float | None:
    """GB/s of cudaMemcpyAsync from the agent's arena (already registered by the CUDA device)
    into device memory: the copy-engine mechanism, without rings. None where the device has
    not mapped the arena (the DMA engine's process maps it instead)."""
    import cupy as cp

    src = int(device.regions[arena_region]["base"])
    nbytes = min(nbytes, int(device.regions[arena_region]["size"]))
    if nbytes == 0:
        return None
    dst = cp.empty(nbytes, cp.uint8)
    return copy_gbps(dst.data.ptr, src, nbytes, repeats)
