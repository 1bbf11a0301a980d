"""The agent as an aarch64 process (Debian's arm64 Python under qemu-aarch64 -L, built by
scripts/arm64_env.sh), served to this x86 host client over loopback."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from host_client.launcher import AgentProcess

REPO = Path(__file__).resolve().parents[2]
ARM = REPO / ".arm64"


def arm64_interpreter() -> list[str]:
    qemu = shutil.which("qemu-aarch64")
    python = ARM / "root" / "usr" / "bin" / "python3.11"
    if qemu is None or not python.exists():
        pytest.fail("no aarch64 environment: run `make test-arm64` (scripts/arm64_env.sh)")
    return [qemu, "-L", str(ARM / "root"), str(python)]


def arm64_env() -> dict[str, str]:
    return {"PYTHONPATH": f"{ARM / 'site'}:{REPO}"}


STARTUP_SECONDS = 420
"""The agent's first start under qemu compiles its Numba loops for aarch64 with an empty cache
(a clean clone): about two minutes on the 2-core VM (bench/results/arm64.json,
``startup_cold_s``), where a warm start takes ~20 s."""


@pytest.fixture(scope="module")
def arm_agent() -> Iterator[AgentProcess]:
    with AgentProcess('[arena]\nbytes = "128MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n',
                      env=arm64_env(), interpreter=arm64_interpreter(),
                      startup_timeout=STARTUP_SECONDS) as agent:
        yield agent
