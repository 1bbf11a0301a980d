"""Where Numba keeps the compiled code of this project's loops (the agent's routing fold and
cache policy, the NIC stand-in's and the worker's packet engine: ``@njit(cache=True)``).

Numba caches next to the module (its ``__pycache__``), in the user's cache directory for an
installed package, or in ``NUMBA_CACHE_DIR``; with none of them usable (a read-only install run
by a user without a home directory) importing the module fails. :func:`keep_cache` gives such a
process a private directory instead.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import numba


def private_cache_dir() -> Path:
    """This user's directory for Numba's cache under the system's temporary directory
    (``dpu-expert-offload-numba-UID``), made 0700 if absent. RuntimeError naming it when it
    is not a directory of this user's that only this user may write (another user could plant
    cache files there, which Numba would load as code)."""
    path = Path(tempfile.gettempdir()) / f"dpu-expert-offload-numba-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise RuntimeError(f"{path}: cannot make Numba's cache directory ({exc}); set "
                           "NUMBA_CACHE_DIR to a writable directory") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path}: not a directory only this user may write (mode "
                           f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}); refusing it "
                           "as Numba's cache: set NUMBA_CACHE_DIR")
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
