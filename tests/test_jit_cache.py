"""Numba's cache where the package cannot hold it: a copy of the packages whose ``__pycache__``
places are files (nothing can be written there, not even by root), run with a home directory
that cannot exist and no ``NUMBA_CACHE_DIR``. The agent's compiled loops and the packet engine
then cache in a private directory of the user's (dpu_offload/jit.py) instead of failing at
import, and a directory others may write is refused by name."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dpu_agent", "dpu_offload", "gpu_kernels")
PROGRAM = """
import numba
from dpu_agent.planning import placement
from dpu_agent.weights import reuse
from gpu_kernels import packet_twin
reuse.warm_up()
placement.warm_up()
packet_twin.warm_up()
print(numba.config.CACHE_DIR)
"""


def _unwritable_copy(tmp: Path) -> dict[str, str]:
    """The packages copied under ``tmp/site`` without caches, a file where each package's
    ``__pycache__`` would go; the environment to run them with (its temporary directory
    ``tmp/t``)."""
    site = tmp / "site"
    for name in PACKAGES:
        shutil.copytree(ROOT / name, site / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder in [site, *site.rglob("*")]:
        if folder.is_dir():
            (folder / "__pycache__").write_text("not a directory")
    (tmp / "t").mkdir()
    (tmp / "home-file").write_text("")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NUMBA_", "XDG_CACHE", "PYTHONPATH"))}
    env.update(PYTHONPATH=str(site), HOME=str(tmp / "home-file" / "home"), TMPDIR=str(tmp / "t"))
    return env


def test_compiled_loops_cache_in_a_private_directory_when_the_package_cannot(
        tmp_path: Path) -> None:
    env = _unwritable_copy(tmp_path)
    run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    private = tmp_path / "t" / f"dpu-expert-offload-numba-{os.getuid()}"
    assert run.stdout.strip() == str(private)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    cached = {p.name.split(".")[0] for p in private.rglob("*.nbi")}
    assert {"stats", "reuse_state", "placement", "packet_twin"} <= cached, sorted(cached)


def test_a_cache_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    env = _unwritable_copy(tmp_path)
    planted = tmp_path / "t" / f"dpu-expert-offload-numba-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert f"{planted}: not a directory only this user may write" in run.stderr
    assert "NUMBA_CACHE_DIR" in run.stderr
    assert not any(planted.iterdir())


@pytest.mark.parametrize("given", [True, False])
def test_numba_cache_dir_or_a_writable_package_is_left_to_numba(tmp_path: Path,
                                                                 given: bool) -> None:
    """``NUMBA_CACHE_DIR`` wins; a package that can hold its cache keeps it (no private
    directory is made)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    if given:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "given")
    run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == (str(tmp_path / "given") if given else "")
    assert not list(tmp_path.glob("dpu-expert-offload-numba-*"))


CUPY = """
import os
from dpu_offload.jit import keep_cupy_cache
keep_cupy_cache()
print(os.environ.get("CUPY_CACHE_DIR", ""))
"""


def _cupy_env(tmp: Path, usable_home: bool) -> dict[str, str]:
    """The environment for :data:`CUPY` without ``CUPY_CACHE_DIR``: its temporary directory
    ``tmp/t``, its home ``tmp/home`` or one that cannot exist (under a file)."""
    (tmp / "t").mkdir()
    (tmp / "home-file").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_DIR"}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp / "t"),
               HOME=str(tmp / ("home" if usable_home else "home-file/home")))
    return env


@pytest.mark.parametrize("home", ["unusable", "writable", "given"])
def test_cupys_kernel_cache_goes_where_this_user_may_write(tmp_path: Path, home: str) -> None:
    """CuPy caches the modules it compiles under ``$HOME/.cupy`` unless ``CUPY_CACHE_DIR``
    says otherwise, and fails its import where it cannot (seen as a second user run with
    root's ``HOME``): then a private directory is named, as for Numba's cache; a usable home
    and a given ``CUPY_CACHE_DIR`` are left as they are."""
    env = _cupy_env(tmp_path, usable_home=home != "unusable")
    if home == "given":
        env["CUPY_CACHE_DIR"] = str(tmp_path / "given")
    run = subprocess.run([sys.executable, "-c", CUPY], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    private = tmp_path / "t" / f"dpu-expert-offload-cupy-{os.getuid()}"
    want = {"unusable": str(private), "writable": "", "given": str(tmp_path / "given")}[home]
    assert run.stdout.strip() == want
    assert private.is_dir() == (home == "unusable")
    if home == "unusable":
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert (tmp_path / "home" / ".cupy" / "kernel_cache").is_dir() == (home == "writable")


def test_a_cupy_cache_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    env = _cupy_env(tmp_path, usable_home=False)
    planted = tmp_path / "t" / f"dpu-expert-offload-cupy-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    run = subprocess.run([sys.executable, "-c", CUPY], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    assert f"{planted}: not a directory only this user may write" in run.stderr
    assert "CUPY_CACHE_DIR" in run.stderr
