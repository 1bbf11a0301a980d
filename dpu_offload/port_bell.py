"""A packet ring's doorbell that poll(2) can wait on: a named FIFO beside the ring's segment
(``<ring name>.bell`` in /dev/shm). The ring's producer writes a byte into it after publishing
entries; the consumer sleeps in poll(2) on it (the NIC stand-in together with its senders'
socket, docs/ACTIVATIONS.md) instead of napping between looks at the ring, so a message wakes
the next process in the path at once and an idle one spends no CPU.

The FIFO is level-triggered and holds its bytes until read: a byte written while the consumer
was busy makes its next wait return at once (it looks at the ring again and finds the entries
or nothing), so no publication is missed; a full FIFO (64 KiB unread) means a wake is pending
anyway, and the write is dropped. Both ends open it read-write, so it never reports a hang-up
while the other end is away. Whether a ring's producer rings at all is the ring header's
``doorbell`` word (``abi.HEADER_DTYPE``): a GPU kernel producing does not.

On a BlueField the rx side is the completion the NIC posts to the GPU's receive queue and the
tx side the doorbell record a GPUNetIO kernel writes to start the send queue (docs/DOCA.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat

from dpu_offload.shm import FIFO_SUFFIX, SHM_DIR, SharedBufferError, give_to_group

_DRAIN_BYTES = 4096


def bell_path(ring_name: str) -> str:
    """Where the doorbell of the ring segment ``ring_name`` lives."""
    return os.path.join(SHM_DIR, ring_name + FIFO_SUFFIX)


class PortBell:
    """One end of a ring's doorbell FIFO, open read-write and non-blocking.

    Args:
        fd: the open FIFO.
        path: its path (unlinked by :meth:`unlink`, the creator's duty).
    """

    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self.path = path
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def create(cls, ring_name: str) -> PortBell | None:
        """Make the doorbell of ``ring_name`` (0600, or 0660 in the group segments are shared
        with: ``shm.share_with_group``), before the ring's segment exists, so nobody can make
        it first under a name they read in /dev/shm. None where FIFOs cannot be made (the
        ring's consumer then polls)."""
        path = bell_path(ring_name)
        try:
            os.mkfifo(path, 0o600)
        except (OSError, AttributeError):
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            os.unlink(path)
            return None
        try:
            give_to_group(fd, f"the doorbell {path}")
        except SharedBufferError:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(fd, path)

    @classmethod
    def open(cls, ring_name: str) -> PortBell | None:
        """The doorbell another process made for the ring segment ``ring_name``; None if it has
        none. ValueError when what is there is not a FIFO owned by the segment's owner and
        closed to others (a planted file must not become a way in, or a busy loop): no one
        else may write it, but for the segment's own group where the segment is shared with
        one (0660)."""
        path = bell_path(ring_name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"the doorbell {path} cannot be opened: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            ring = os.stat(os.path.join(SHM_DIR, ring_name))
            if not stat.S_ISFIFO(st.st_mode):
                raise ValueError(f"the doorbell {path} is not a FIFO")
            shared = ring.st_mode & 0o020 and st.st_gid == ring.st_gid
            if st.st_uid != ring.st_uid or st.st_mode & (0o002 if shared else 0o022):
                raise ValueError(f"the doorbell {path} is not the ring owner's alone (uid "
                                 f"{st.st_uid}, gid {st.st_gid}, mode "
                                 f"{stat.S_IMODE(st.st_mode):o}; the ring's owner is uid "
                                 f"{ring.st_uid}, gid {ring.st_gid})")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def fileno(self) -> int:
        """The FIFO's descriptor (readable while a wake is pending), for a poller."""
        return self._fd

    def ring(self) -> None:
        """After publishing entries: wake the consumer (it may be busy: then the byte waits)."""
        try:
            os.write(self._fd, b"\1")
        except BlockingIOError:
            pass  # full: a wake is pending already
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise

    def drain(self) -> None:
        """Consume the pending wakes (before looking at the ring)."""
        try:
            while len(os.read(self._fd, _DRAIN_BYTES)) == _DRAIN_BYTES:
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float) -> bool:
        """Sleep until a wake is pending or ``timeout`` seconds pass; consumes the wakes.
        Whether one was pending."""
        if not self._poll.poll(max(0, int(timeout * 1000))):
            return False
        self.drain()
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
