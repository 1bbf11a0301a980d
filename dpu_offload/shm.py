"""POSIX shared memory buffers: how the agent's arena and the host client's rings are shared
between processes here (on a BlueField, doca_mmap exports replace them; see docs/DOCA.md).

Python's ``multiprocessing.shared_memory`` registers every segment with a resource tracker that
unlinks it when *any* attaching process exits, so the owner here manages lifetime itself.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import re
import secrets

import numpy as np

SHM_DIR = "/dev/shm"
FIFO_SUFFIX = ".bell"
"""A segment's doorbell FIFO is its name with this suffix (``dpu_offload.port_bell``)."""
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Linux's; elsewhere pages are backed as they are first touched."""


class SharedBufferError(RuntimeError):
    """A shared buffer could not be created or opened; the message names it."""


_group: int | None = None
"""The group this process shares the segments it creates with (``share_with_group``)."""


def group_id(text: str) -> int:
    """The group named ``text`` (a name in the group database, or a number); ValueError naming
    it when there is no such group or this process may not give files to it (it is neither
    root nor a member)."""
    import grp

    try:
        gid = int(text) if text.isdigit() else grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no group named {text!r}") from None
    if not _valid(gid):
        raise ValueError(f"group id {gid} is out of range")
    if not _member(gid):
        raise ValueError(f"this process (uid {os.geteuid()}) is not a member of group {text!r}")
    return gid


def _valid(gid: int) -> bool:
    return 0 <= gid < 2**32 - 1  # 2**32 - 1 is chown's "leave the group as it is"


def _member(gid: int) -> bool:
    return os.geteuid() == 0 or gid == os.getegid() or gid in os.getgroups()


def may_share_with(gid: int) -> bool:
    """Whether this process may give the files it creates to group ``gid`` (a valid id; root
    or a member): what ``group_id`` checks, for a group known by number."""
    return _valid(gid) and _member(gid)


def share_with_group(gid: int | None) -> None:
    """From now on the segments (and their doorbell FIFOs) this process creates are 0660 and
    belong to group ``gid``, so processes of other Unix users in that group can map them: how
    an agent running as its service user and inference processes of other users share memory
    here (docs/DEPLOY.md). None: 0600, this user's alone (the default). Process-wide, as the
    umask is; the caller must be root or a member of the group (``group_id``)."""
    global _group
    _group = gid


def give_to_group(fd: int, what: str) -> None:
    """Make the file open at ``fd`` 0660 in the shared group, if one is set (``what`` names
    it in the error)."""
    if _group is None:
        return
    try:
        os.fchown(fd, -1, _group)
        os.fchmod(fd, 0o660)
    except OSError as exc:
        raise SharedBufferError(f"{what}: cannot give it to group {_group}: "
                                f"{exc.strerror}") from exc


def unique_name(prefix: str) -> str:
    """A fresh segment name: ``prefix``, the creator's pid (so a later agent can tell a dead
    creator's leftovers, ``sweep_stale``) and 128 random bits (so no one guesses it; the
    segment is also 0600, or 0660 in the group of ``share_with_group``)."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(16)}"


_TAG_HEX = 32
"""Hex digits of a session-bound name's tag (128 bits of HMAC-SHA256)."""


def token_digest(token: str) -> bytes:
    """SHA-256 of a session token: all the agent keeps of it, and the key that binds the
    session's segment names (:func:`session_name`)."""
    return hashlib.sha256(token.encode()).digest()


def _tag(digest: bytes, base: str) -> str:
    return hmac.new(digest, base.encode(), hashlib.sha256).hexdigest()[:_TAG_HEX]


def session_name(prefix: str, token: str) -> str:
    """A fresh segment name bound to the session whose token is ``token``: ``unique_name``'s
    form, its random part a 64-bit nonce followed by an HMAC-SHA256 tag of the name so far,
    keyed by the token's digest. The agent registers a client's segment for a session only
    if its name is bound to that session (:func:`bound_to`), so a caller who reads the name
    in /dev/shm cannot register it in another session: it could not have created it."""
    base = f"{prefix}-{os.getpid()}-{secrets.token_hex(8)}"
    return base + _tag(token_digest(token), base)


def bound_to(name: str, digest: bytes) -> bool:
    """Whether ``name`` came from :func:`session_name` for the session whose token has this
    ``digest``."""
    base, tag = name[:-_TAG_HEX], name[-_TAG_HEX:]
    # bytes: compare_digest refuses str with non-ASCII characters (a client's name may hold any)
    return len(name) > _TAG_HEX and hmac.compare_digest(_tag(digest, base).encode(),
                                                         tag.encode())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_stale(prefixes: tuple[str, ...], directory: str = SHM_DIR) -> list[str]:
    """Unlink the segments named ``<prefix>-<pid>-<hex>`` (``unique_name``) that this user
    owns and whose creating process is gone (a crashed agent's arena, a dead client's rings);
    a live process's segments, and other users', are never touched; a segment's doorbell FIFO
    (``FIFO_SUFFIX``) goes with it. Returns the names removed.
    /dev/shm does not outlive a boot, so a pid names one process of this boot (a reused pid
    only keeps a segment longer)."""
    pattern = re.compile(rf"^(?:{'|'.join(map(re.escape, prefixes))})-(\d+)-[0-9a-f]+"
                         rf"(?:{re.escape(FIFO_SUFFIX)})?$")
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if m is None or _alive(int(m[1])):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue  # gone meanwhile
    return removed


class SharedBuffer:
    """A named, mapped shared-memory segment of ``size`` bytes.

    Attributes:
        name: the segment name (a file under /dev/shm), the export handle other processes open.
        size: bytes.
        array: ``uint8[size]`` NumPy view of the mapping.
        owner: whether this process created it (and unlinks it on :meth:`unlink`).

    ``populate``: back every page now (``MAP_POPULATE``: the creator's pages are allocated, an
    opener's mapped), as device memory is backed when allocated, so the first write into a
    page does not pay a page fault on the data path. Only for memory that will all be used (a
    slot pool), never for a sparse one (the arena is filled as experts are read).
    """

    def __init__(self, name: str, size: int | None = None, *, create: bool = False,
                 populate: bool = False) -> None:
        if not _NAME_RE.match(name):
            raise SharedBufferError(f"invalid shared memory name {name!r}")
        path = os.path.join(SHM_DIR, name)
        self.name = name
        self.owner = create
        try:
            if create:
                if size is None or size <= 0:
                    raise SharedBufferError(f"shared memory {name!r}: size must be positive")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, size)
                    give_to_group(fd, f"shared memory {name!r}")
                except (OSError, SharedBufferError):
                    os.close(fd)
                    os.unlink(path)
                    raise
            else:
                fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise SharedBufferError(f"shared memory {name!r} does not exist") from exc
        except PermissionError as exc:
            raise SharedBufferError(
                f"shared memory {name!r}: permission denied (another Unix user made it; the "
                "agent and its clients share memory through a group they are both members of: "
                "[sessions] shm_group, docs/DEPLOY.md)") from exc
        except OSError as exc:
            raise SharedBufferError(f"shared memory {name!r}: {exc.strerror}") from exc
        try:
            actual = os.fstat(fd).st_size
            if size is not None and actual < size:
                raise SharedBufferError(
                    f"shared memory {name!r} holds {actual} bytes, {size} expected")
            self.size = size if size is not None else actual
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
            self._mmap = mmap.mmap(fd, self.size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    @property
    def address(self) -> int:
        """Virtual address of the mapping in this process."""
        return int(self.array.ctypes.data)

    def close(self) -> None:
        """Unmap. Views handed out must be dropped first; a live view keeps the mapping."""
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes when the last view does

    def unlink(self) -> None:
        """Remove the name (the owner's duty); existing mappings stay valid."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()
