"""Destination: where a pack may write.

Owns: refusing a destination that is the source, lies inside it or contains it (a pack replaces
its destination whole, so any overlap would destroy the checkpoint it reads).
"""
from __future__ import annotations

import os
from pathlib import Path


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
