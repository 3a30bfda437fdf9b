"""Destination: where a pack may write, and the staging directories it keeps beside the destination.

Owns: refusing a destination that is the source, lies inside it or contains it (a pack replaces
its destination whole, so any overlap would destroy the checkpoint it reads); the names of a
pack's staging directories, ``.NAME.tmp-PID`` (the pack being built) and ``.NAME.old-PID`` (the
previous pack, between the two renames that replace it); and removing those that a pack killed
outright (SIGKILL, a power cut) left behind, which no ``finally`` could remove.

Invariant: a staging directory is removed only when its PID names no process running on this
host; those of running processes (another pack of the same destination, or this one) are left
alone. A PID the system has since given to an unrelated process keeps its directory until that
process ends: wasted space for a while, never a removed pack. A pack removes them while it holds
the destination's lock (``loader.lock``), which keeps every other pack of this destination out;
the PID check stays as the guard where the lock does not reach: PIDs are this host's, and a
flock over a network filesystem is only as good as that filesystem's lock support, so do not
run packs of one destination from two hosts at once.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

STAGING_KINDS = ("tmp", "old")


@dataclass(frozen=True)
class StaleDir:
    """A staging directory left by a pack whose process is gone, as it was when removed."""

    path: Path
    pid: int
    nbytes: int  # the files' apparent sizes, summed


def check_apart(src: Path, dst: Path) -> None:
    """Raise ValueError naming both paths if ``dst`` is ``src``, lies inside it or contains it.

    Paths are compared after resolving symlinks and ``..``, and existing directories also by
    identity (device and inode), which catches a bind mount or a case-insensitive spelling.
    """
    s, d = src.resolve(), dst.resolve()
    if _within(d, s):
        relation = "is the source" if d == s or _same(d, s) else "lies inside the source"
    elif _within(s, d):
        relation = "contains the source"
    else:
        return
    raise ValueError(
        f"destination {str(dst)!r} {relation} {str(src)!r}; a pack replaces its destination whole, which would "
        f"destroy the checkpoint it reads: pack into a separate directory, e.g. {s}-packed"
    )


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _within(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies inside it (both resolved)."""
    if inner == outer or outer in inner.parents:
        return True
    return any(_same(p, outer) for p in (inner, *inner.parents) if p.exists())


def staging_dir(dst: Path, kind: str, pid: int | None = None) -> Path:
    """The staging directory of ``kind`` ("tmp" or "old") of the pack ``pid`` (default: this process) into ``dst``."""
    if kind not in STAGING_KINDS:
        raise ValueError(f"staging directory kind {kind!r}; allowed: {list(STAGING_KINDS)}")
    return dst.parent / f".{dst.name}.{kind}-{os.getpid() if pid is None else pid}"


def pid_running(pid: int) -> bool:
    """Whether ``pid`` names a process on this host (one of another user counts). Off POSIX,
    where signal 0 is no probe, every PID counts as running, so nothing is ever removed."""
    if os.name != "posix":
        return True
    if pid <= 0:
        return False  # no process has it (os.kill would address a process group)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def stale_staging(dst: Path) -> list[tuple[Path, int]]:
    """(directory, pid) of each staging directory beside ``dst`` whose pack no longer runs."""
    pattern = re.compile(rf"^\.{re.escape(dst.name)}\.(?:{'|'.join(STAGING_KINDS)})-(\d+)$")
    if not dst.parent.is_dir():
        return []
    found = []
    for p in sorted(dst.parent.iterdir()):
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not pid_running(int(m.group(1))):
            found.append((p, int(m.group(1))))
    return found


def remove_stale(dst: Path) -> list[StaleDir]:
    """Remove the staging directories beside ``dst`` of packs that no longer run; what was removed."""
    removed = []
    for path, pid in stale_staging(dst):
        nbytes = _tree_bytes(path)
        shutil.rmtree(path)
        removed.append(StaleDir(path, pid, nbytes))
    return removed


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass  # gone meanwhile: nothing to count
    return total
