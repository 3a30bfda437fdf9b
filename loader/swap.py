"""Swap: a finished pack takes its destination's place, replacing only what it was given to replace.

Owns: the no-replace rename; ``claim``, which records under the destination's lock what was at
the destination when the pack started; and ``Target.place``, the final swap.

Invariant: the swap never deletes or replaces anything it did not create or was not given.
Without ``overwrite``, or where nothing was at the destination at the start, the pack is renamed
in with a rename that fails if anything (a file, a symlink, even an empty directory) is there.
With ``overwrite``, the one thing replaced is what was at the destination at the start, pinned by
an open descriptor (so its inode number cannot be given to anything else meanwhile) and compared
by device and inode at the end; anything else found there is an error, not a deletion. The lock
(``loader.lock``) keeps other packs out; these checks are against everyone else.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .destination import staging_dir

_AT_FDCWD = -100  # linux/fcntl.h: paths relative to the working directory
_RENAME_NOREPLACE = 1  # linux/fs.h
# What renameat2 answers where the kernel (ENOSYS) or the filesystem (EINVAL) lacks the flag.
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def _load_renameat2():
    """glibc's renameat2 (2.28 and later), or None off Linux or where the C library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; FileExistsError if anything is at ``dst``.

    Atomic through renameat2(RENAME_NOREPLACE) where the kernel and filesystem have it (Linux 3.15+:
    ext4, xfs, btrfs, tmpfs, ...). Elsewhere a check, then os.rename: the lock keeps packs out of
    that window, and os.rename itself refuses a non-empty directory and a file; only an empty
    directory or a symlink made by another program in the moment between would be replaced.
    """
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None, str(dst))
    os.rename(src, dst)


def exists_error(dst: Path) -> FileExistsError:
    return FileExistsError(f"destination {str(dst)!r} exists; pass --overwrite (overwrite=True) to replace it")


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _identity_at(path: Path) -> tuple[int, int] | None:
    try:
        return _identity(os.lstat(path))
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class Target:
    """What a pack may do at ``dst``: ``replaces`` is the identity (device, inode) of what
    overwrite=True was given to replace, or None where nothing was there at the start."""

    dst: Path
    replaces: tuple[int, int] | None

    def place(self, tmp: Path) -> None:
        """Rename the finished pack ``tmp`` onto the destination, then remove what it replaced."""
        found = _identity_at(self.dst)
        if found is None:  # nothing there, or what was there is gone: nothing to replace
            self._rename_in(tmp)
            return
        if found != self.replaces:
            raise self._error()
        _check_removable(self.dst)  # before anything moves: a pack that cannot finish changes nothing
        old = staging_dir(self.dst, "old")
        rename_noreplace(self.dst, old)
        if _identity_at(old) != self.replaces:  # swapped in the instant since the check: put it back
            rename_noreplace(old, self.dst)
            raise self._error()
        try:
            self._rename_in(tmp)
        except FileExistsError as e:
            raise FileExistsError(f"{e}; what it was to replace is kept at {str(old)!r}") from None
        try:
            _remove(old)
        except OSError as e:
            raise OSError(f"packed into {str(self.dst)!r}, but the pack it replaced, moved to {str(old)!r}, could not be "
                          f"removed ({e}); remove it by hand") from e

    def _rename_in(self, tmp: Path) -> None:
        try:
            rename_noreplace(tmp, self.dst)
        except FileExistsError:
            raise self._error() from None

    def _error(self) -> FileExistsError:
        if self.replaces is None:
            what = "appeared while this pack ran (something else created it)"
        else:
            what = "was replaced while this pack ran (it is no longer what overwrite=True was given to replace)"
        return FileExistsError(f"destination {str(self.dst)!r} {what}; it is left untouched and this pack's output "
                               f"removed: pack again (with --overwrite to replace it), or into another directory")


@contextmanager
def claim(dst: Path, *, overwrite: bool) -> Iterator[Target]:
    """Under the destination's lock: what the pack may replace at ``dst``. FileExistsError if
    something is there and not ``overwrite``. Holds what is there open until the body ends."""
    if not os.path.lexists(dst):
        yield Target(dst, None)
        return
    if not overwrite:
        raise exists_error(dst)
    o_path = getattr(os, "O_PATH", None)  # Linux: an fd to the inode itself, a symlink's too, whatever its mode
    fd = os.open(dst, o_path | os.O_NOFOLLOW | os.O_CLOEXEC) if o_path is not None else None
    try:
        yield Target(dst, _identity(os.fstat(fd)) if fd is not None else _identity(os.lstat(dst)))
    finally:
        if fd is not None:
            os.close(fd)


def _check_removable(root: Path) -> None:
    """PermissionError naming the first directory under ``root`` whose entries cannot be removed."""
    if root.is_symlink() or not root.is_dir():
        return  # unlinking it needs only the parent, which the rename checks

    def unreadable(e: OSError) -> None:
        raise e

    for dirpath, _, _ in os.walk(root, onerror=unreadable):
        if not os.access(dirpath, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(f"cannot replace destination {str(root)!r}: {dirpath!r} is read-only, so the pack it "
                                  f"holds could not be removed; nothing was changed (make it writable, or pack elsewhere)")


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)
