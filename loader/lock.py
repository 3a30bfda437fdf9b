"""Lock: one pack at a time per destination, through an OS lock on ``.NAME.lock`` beside it.

Owns: the lock file's name, taking the lock (never waiting: a second pack fails at once, naming
the destination and the holder's pid), what the holder writes in it (its pid and host, for that
message only), and releasing it on every exit path.

Invariant: while ``hold`` runs its body, this open file description holds ``flock(LOCK_EX)`` on
the inode that the lock file's name points at. The kernel drops a flock when its holder dies, so
a pack killed outright leaves a stale file that blocks nothing: the next pack locks and reuses it.
The holder unlinks the file while still holding it, so nothing is left beside the destination;
because of that unlink, a pack that locks an inode checks that the name still points at it (a
holder may have unlinked it between this pack's open and its flock) and otherwise starts over.
The lock is advisory: it excludes other packs, not other programs. POSIX only (fcntl), as the
disk store's preadv already is.
"""
from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# A name that keeps pointing at another inode each time is a holder releasing as fast as packs
# start; past this many rounds that is reported as the contention it is.
_ATTEMPTS = 100


class DestinationLocked(OSError):
    """Another pack holds the destination's lock. ``pid`` is the holder's pid where it wrote one
    (``host`` its host's name), else None."""

    def __init__(self, msg: str, *, dst: Path, lock: Path, pid: int | None, host: str | None):
        super().__init__(msg)
        self.dst, self.lock, self.pid, self.host = dst, lock, pid, host


def lock_path(dst: Path) -> Path:
    """The lock file of packs into ``dst``: ``.NAME.lock`` in the destination's parent."""
    return dst.parent / f".{dst.name}.lock"


@contextmanager
def hold(dst: Path) -> Iterator[Path]:
    """Hold the lock on ``dst`` for the body (its parent must exist); raise DestinationLocked at
    once if another pack holds it. Yields the lock file's path."""
    path = lock_path(dst)
    fd = _acquire(dst, path)
    try:
        _write_owner(fd)
        yield path
    finally:
        _release(fd, path)


def _acquire(dst: Path, path: Path) -> int:
    for _ in range(_ATTEMPTS):
        # O_NOFOLLOW: a symlink planted at the lock's name is refused (ELOOP), not followed.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, host = _read_owner(fd)
            os.close(fd)
            raise _locked(dst, path, pid, host) from None
        except BaseException:
            os.close(fd)
            raise
        if _names(path, fd):
            return fd
        os.close(fd)  # locked an inode its holder unlinked on release: lock the current one
    raise _locked(dst, path, None, None)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the inode open at ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _release(fd: int, path: Path) -> None:
    try:
        if _names(path, fd):  # unlink while still holding: no pack can hold this inode meanwhile
            os.unlink(path)
    except OSError:
        # A stale file reused in a directory this pack cannot write: left, a lock that blocks
        # nothing, rather than an error raised here in place of the pack's own (or its success).
        pass
    finally:
        os.close(fd)  # drops the flock


def _write_owner(fd: int) -> None:
    os.ftruncate(fd, 0)  # a stale file reused keeps its dead holder's pid otherwise
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)


def _read_owner(fd: int) -> tuple[int | None, str | None]:
    """The holder's (pid, host), or Nones where it has not written them yet (or wrote garbage)."""
    try:
        words = os.pread(fd, 512, 0).decode("utf-8", "replace").split()
        return int(words[0]), (words[1] if len(words) > 1 else None)
    except (OSError, ValueError, IndexError):
        return None, None


def _locked(dst: Path, path: Path, pid: int | None, host: str | None) -> DestinationLocked:
    if pid is None:
        who = "another pack (its pid unknown)"
    elif host is not None and host != socket.gethostname():
        who = f"another pack (pid {pid} on host {host})"
    else:
        who = f"another pack (pid {pid})"
    msg = (f"destination {str(dst)!r} is being packed by {who}, which holds {path.name} beside it; "
           f"wait for that pack to end, or pack into another directory")
    return DestinationLocked(msg, dst=dst, lock=path, pid=pid, host=host)

