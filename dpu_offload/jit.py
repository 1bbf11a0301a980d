"""Where compiled code is cached: Numba's for this project's loops (the agent's routing fold
and cache policy, the NIC stand-in's and the worker's packet engine: ``@njit(cache=True)``) and
CuPy's for the CUDA modules it compiles (the kernels of ``gpu_kernels``, its own elementwise
kernels).

Numba caches next to the module (its ``__pycache__``), in the user's cache directory for an
installed package, or in ``NUMBA_CACHE_DIR``; CuPy in ``CUPY_CACHE_DIR`` or
``~/.cupy/kernel_cache``. With none of them usable (a read-only install run by a user without a
home directory, a process run as another user with this one's ``HOME``) the import fails:
:func:`keep_cache` and :func:`keep_cupy_cache` give such a process a private directory instead.
Both caches hold code the process loads and runs, so a directory others may write is refused.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import numba


def private_cache_dir(what: str = "numba", setting: str = "NUMBA_CACHE_DIR") -> Path:
    """This user's directory for ``what``'s cache under the system's temporary directory
    (``dpu-expert-offload-WHAT-UID``), made 0700 if absent. RuntimeError naming it and
    ``setting`` (the variable that chooses another) when it is not a directory of this user's
    that only this user may write (another user could plant cache files there, which would be
    loaded as code)."""
    path = Path(tempfile.gettempdir()) / f"dpu-expert-offload-{what}-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise RuntimeError(f"{path}: cannot make {what}'s cache directory ({exc}); set "
                           f"{setting} to a writable directory") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path}: not a directory only this user may write (mode "
                           f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}); refusing it "
                           f"as {what}'s cache: set {setting}")
    return path


def keep_cache(module_file: str) -> None:
    """Call before decorating ``module_file``'s functions with ``cache=True``: unless
    ``NUMBA_CACHE_DIR`` names a place or the module's ``__pycache__`` takes files (what Numba
    tries first), Numba caches in :func:`private_cache_dir` (for every function decorated from
    then on in this process)."""
    if numba.config.CACHE_DIR:
        return
    pycache = Path(module_file).resolve().parent / "__pycache__"
    try:
        pycache.mkdir(exist_ok=True)
        tempfile.TemporaryFile(dir=pycache).close()
        return
    except OSError:
        numba.config.CACHE_DIR = str(private_cache_dir())


def keep_cupy_cache() -> None:
    """Call before importing CuPy: unless ``CUPY_CACHE_DIR`` is set or CuPy's default
    (``~/.cupy/kernel_cache``) can be made and written, CuPy caches its compiled modules in
    :func:`private_cache_dir` (``CUPY_CACHE_DIR`` set for this process and its children)."""
    if os.environ.get("CUPY_CACHE_DIR"):
        return
    default = Path.home() / ".cupy" / "kernel_cache"
    try:
        default.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=default).close()
    except OSError:
        os.environ["CUPY_CACHE_DIR"] = str(private_cache_dir("cupy", "CUPY_CACHE_DIR"))
