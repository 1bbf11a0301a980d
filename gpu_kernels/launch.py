"""Loading and launching the CUDA kernels through CuPy (imported only here, lazily).

The rules learned from GPUNetIO hold: ``CUDA_MODULE_LOADING=EAGER`` is set before CUDA starts
(lazy loading can deadlock beside a persistent kernel), every launch goes on a non-blocking
stream, and nothing here synchronises the whole device. ``CUDA_DEVICE_MAX_CONNECTIONS`` is
raised to 32 (unless set) for the same reason: kernels that wait on the GPU for the DMA
engine's bytes sit in a hardware queue, and with CUDA's default of 8 queues, streams beyond
them share one, so the inference process's own kernels queued behind such a wait stall until
it ends (measured: expert compute 2.0-2.2x the resident run's with 8, 0.97-1.3x with 32;
docs/PERFORMANCE-NOTES.md). Both take effect only if CUDA has not started in the process.
Loading a module waits for the device to drain, so a module first loaded while a persistent
kernel runs stalls until that kernel ends: ``preload`` loads all of this package's modules
first. CuPy's kernel cache goes where this user may write it (``dpu_offload.jit``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import dpu_offload
from dpu_offload.jit import keep_cupy_cache

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
keep_cupy_cache()

import cupy as cp  # noqa: E402  (after the environment it reads at import)

KERNEL_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = Path(dpu_offload.__file__).resolve().parent / "include"
"""Where the ring ABI's C header (``ring.cuh``, a contract) lives."""


def arch_option(device: cp.cuda.Device | None = None) -> str:
    """``--gpu-architecture`` for the device, real machine code (sm_XX) rather than PTX."""
    return f"--gpu-architecture=sm_{(device or cp.cuda.Device()).compute_capability}"


@functools.cache
def module(name: str, device_id: int = 0) -> cp.RawModule:
    """Compile ``gpu_kernels/<name>.cu`` for the device (cached per process)."""
    with cp.cuda.Device(device_id) as dev:
        code = (KERNEL_DIR / f"{name}.cu").read_text()
        return cp.RawModule(code=code, options=("-std=c++17", f"-I{INCLUDE_DIR}",
                                                f"-I{KERNEL_DIR}", arch_option(dev)),
                            name_expressions=None)


def kernel(module_name: str, function: str, device_id: int | None = None) -> Any:
    """A compiled kernel function for ``device_id`` (default: the current device)."""
    return _kernel(module_name, function,
                   cp.cuda.Device().id if device_id is None else device_id)


@functools.cache
def _kernel(module_name: str, function: str, device_id: int) -> Any:
    return module(module_name, device_id).get_function(function)


def preload(device_id: int = 0) -> None:
    """Compile and load every ``gpu_kernels/*.cu`` module for the device now."""
    for source in sorted(KERNEL_DIR.glob("*.cu")):
        module(source.stem, device_id).compile()


def non_blocking_stream() -> cp.cuda.Stream:
    """A stream that never serialises with the legacy default stream."""
    return cp.cuda.Stream(non_blocking=True)


@functools.cache
def shared_stream(device_id: int, name: str) -> cp.cuda.Stream:
    """The process's one non-blocking stream called ``name`` on the device: work that many
    objects enqueue (landed-slot checks) stays on a fixed few streams, and so a fixed few
    hardware queues, however many devices a process attaches over its life."""
    with cp.cuda.Device(device_id):
        return non_blocking_stream()


@functools.cache
def sm_count(device_id: int = 0) -> int:
    """Multiprocessors of the device (cached: cudaGetDeviceProperties costs far more than a
    kernel launch, and launchers size their grids with it on every call)."""
    return int(cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])
