"""Cold tier: the packed expert files on disk, read with pread straight into a caller's buffer.

Owns: file handles, size checks and checksum verification. Invariants: every blob is checked
against its manifest CRC32 the first time it is read (``verify="first"``, the default) or on
every read (``"always"``), after it has landed in the destination buffer, so the bytes checked
are the bytes used; a missing file, a short file or a mismatch raises ``IntegrityError`` naming
the file and the expert, never returns wrong weights.
"""
from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

import torch

from loader.layout import ExpertKey
from loader.packed import BlobRef, Manifest


class IntegrityError(RuntimeError):
    pass


class DiskStore:
    def __init__(self, manifest: Manifest, precisions: list[str], *, verify: str = "first"):
        if verify not in ("first", "always"):
            raise ValueError(f"verify: expected 'first' or 'always', got {verify!r}")
        self.manifest = manifest
        self.verify = verify
        self._verified: set[tuple[ExpertKey, str]] = set()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # reads may come from reader threads
        needed: dict[str, tuple[int, ExpertKey]] = {}  # file -> (required size, an expert in it)
        for key in manifest.keys:
            for p in precisions:
                ref = manifest.ref(key, p)
                end = ref.offset + ref.nbytes
                if end > needed.get(ref.file, (0, key))[0]:
                    needed[ref.file] = (end, key)
        for rel, (size, key) in needed.items():
            path = manifest.root / rel
            if not path.is_file():
                raise IntegrityError(f"expert file {str(path)!r} is missing (it holds {key} among others)")
            actual = path.stat().st_size
            if actual < size:
                raise IntegrityError(
                    f"expert file {str(path)!r} is truncated: {actual} bytes, the manifest needs {size} (for {key})"
                )

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                fd = os.open(self.manifest.root / rel, os.O_RDONLY)
                self._fds[rel] = fd
            return fd

    def read(self, key: ExpertKey, precision: str, out: torch.Tensor) -> BlobRef:
        """Read one blob into the uint8 CPU tensor ``out`` (at least ``nbytes`` long)."""
        ref = self.manifest.ref(key, precision)
        path = self.manifest.root / ref.file
        dst = out[: ref.nbytes]
        assert dst.device.type == "cpu" and dst.dtype == torch.uint8 and dst.is_contiguous()
        view = memoryview(dst.numpy())
        got = 0
        try:
            fd = self._fd(ref.file)
            while got < ref.nbytes:
                n = os.preadv(fd, [view[got:]], ref.offset + got)
                if n == 0:
                    break
                got += n
        except FileNotFoundError:
            raise IntegrityError(f"expert file {str(path)!r} is missing ({key}, {precision})") from None
        if got != ref.nbytes:
            raise IntegrityError(f"expert file {str(path)!r} is truncated: read {got} of {ref.nbytes} bytes for {key} ({precision})")
        tag = (key, precision)
        if self.verify == "always" or tag not in self._verified:
            crc = zlib.crc32(view[: ref.nbytes])
            if crc != ref.crc32:
                raise IntegrityError(
                    f"checksum mismatch in {str(path)!r} for {key} ({precision}) at offset {ref.offset}: "
                    f"crc32 {crc:#010x}, manifest says {ref.crc32:#010x}; the file is corrupt, re-pack it"
                )
            with self._lock:
                self._verified.add(tag)
        return ref

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
