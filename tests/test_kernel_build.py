"""Every CUDA source compiles for Hopper (sm_90) with the host's nvcc, where there is one; the
GPU machine runs the kernels themselves (``gpu`` marker)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import dpu_offload

KERNELS = Path(__file__).resolve().parents[1] / "gpu_kernels"
INCLUDE = Path(dpu_offload.__file__).resolve().parent / "include"
"""The ring ABI's C header, a contract (as ``gpu_kernels.launch.INCLUDE_DIR``)."""
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("source", sorted(p.name for p in KERNELS.glob("*.cu")))
def test_kernel_compiles_for_sm90(tmp_path: Path, source: str) -> None:
    res = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", f"-I{INCLUDE}", "-c",
                          str(KERNELS / source), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
