"""Simulated disk faults for pack's tests (no test should fill a disk, and root writes anywhere):
a full disk (ENOSPC) or a file over its size limit (EFBIG) partway through pack's writes, and a
read-only filesystem (EROFS) under one directory. Each records that it fired, so a test can check
it failed where it meant to."""
from __future__ import annotations

import errno
import importlib
import os
from pathlib import Path

pack_module = importlib.import_module("tiers.loader.pack")
MANIFEST = importlib.import_module("tiers.loader.packed").MANIFEST

# Where the fault strikes: which of pack's files, and how many writes into it succeed first
# (an experts file: its header and one expert's blob really land on disk).
WHERE = {"dense": ("dense-", 0), "experts": ("layer-", 2), "manifest": (MANIFEST, 0)}


class _FailingFile:
    """A real file whose writes succeed ``ok`` times, then raise OSError(code) as a full disk does."""

    def __init__(self, f, ok: int, code: int, fired: list):
        self._f, self._ok, self._code, self._fired = f, ok, code, fired

    def write(self, data):
        if self._ok <= 0:
            self._fired.append(os.path.basename(self._f.name))
            raise OSError(self._code, os.strerror(self._code))  # as the kernel's: no file named
        self._ok -= 1
        return self._f.write(data)

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def full_disk(monkeypatch, code: int, where: str) -> list[str]:
    """Make pack's writes fail with ``code`` (ENOSPC, EFBIG) at ``where`` (a WHERE key); the
    returned list gets the name of each file whose write failed."""
    prefix, ok = WHERE[where]
    fired: list[str] = []

    def fake_open(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        if "w" in mode and os.path.basename(file).startswith(prefix):
            return _FailingFile(f, ok, code, fired)
        return f

    real_write_text = Path.write_text

    def fake_write_text(self, data, *args, **kwargs):
        if self.name.startswith(prefix):
            fired.append(self.name)
            raise OSError(code, os.strerror(code))
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(pack_module, "open", fake_open, raising=False)  # shadows the builtin in pack's module only
    monkeypatch.setattr(Path, "write_text", fake_write_text)
    return fired


def read_only_fs(monkeypatch, root: Path) -> list[str]:
    """Make creating anything under ``root`` fail with EROFS, as on a filesystem mounted read-only;
    the returned list gets each path refused."""
    fired: list[str] = []
    real_open, real_mkdir = os.open, os.mkdir
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC

    def refuse(path) -> None:
        if Path(os.fsdecode(path)).is_relative_to(root):
            fired.append(os.fsdecode(path))
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def fake_open(path, flags, *args, **kwargs):
        if flags & writes:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    return fired
