"""Cold tier: the packed expert files on disk, read with pread straight into a caller's buffer.

Owns: file handles, size checks, checksum verification, the optional pool of chunk-reader threads
and page-cache eviction (``drop_page_cache``). Invariants: every blob is checked against its
manifest CRC32 the first time it is read (``verify="first"``, the default), again on its next
read once its file changed (its inode, size, mtime or ctime differs from when it was last
checked), or on every read (``"always"``), after it has landed in the destination buffer, so the
bytes checked are the bytes used; a missing file, a short file or a mismatch raises ``IntegrityError`` naming the file and the
expert, never returns wrong weights. A chunked read returns (or raises) only after every one of
its chunks has finished, so no pool thread writes into ``out`` once ``read`` is back.
"""
from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from tiers.loader.blob import BLOB_ALIGN
from tiers.loader.layout import ExpertKey
from tiers.loader.pack_files import IntegrityError
from tiers.loader.packed import BlobRef, Manifest


def drop_page_cache(paths: Iterable[str | Path]) -> bool:
    """Evict the clean page-cache pages of each file, so that the next read of it comes from the disk.

    Dirty pages are written back first (``fdatasync``): fresh from a pack, a file's pages are still
    dirty and ``POSIX_FADV_DONTNEED`` alone would leave them cached. Advisory: pages another
    process has mapped stay. Returns False where it is not possible (no ``posix_fadvise`` on this
    platform, or a file that cannot be opened or advised), True when every file was advised.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    ok = True
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def _stamp(fd: int) -> tuple[int, ...]:
    """What changes when an open file's content may have: its inode, size, mtime and ctime.
    The ctime cannot be set back by a user (``touch`` sets only the mtime and atime)."""
    st = os.fstat(fd)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """preadv until ``view`` is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class DiskStore:
    """Reads expert blobs of ``precisions`` from ``manifest``'s packed files.

    ``read_threads=0`` reads a blob with preadv on the calling thread. ``read_threads=N`` splits a
    blob longer than ``chunk_bytes`` into ``chunk_bytes`` pieces (the last one shorter) read
    concurrently by N internal threads, while the calling thread checks the CRC32 of each chunk in
    order as it lands. ``chunk_bytes`` is a multiple of 4 KiB, so with 4 KiB aligned blobs and a
    page-aligned ``out`` every request starts on a page boundary. ``read`` may be called from
    several threads at once; they share the N chunk threads.

    Measured on the H200 test machine's virtio disk (``tools/coldread.py``, 2.8 GB of Mixtral-shape
    INT8 blobs, page cache dropped): ``read_threads=1`` 1.6-1.8 GB/s, 2: 1.4, 4: 1.3, 0: 1.0-1.1.
    Most of the gain is the CRC32 overlapping the reads; more threads issue concurrent buffered
    preads on one descriptor, whose shared readahead state they defeat.

    The O_DIRECT rate of one stream is what ``tools/coldread.py`` holds these buffered reads to
    (0.99x in the H200 bench's run 60); reading with O_DIRECT itself was slower there.
    """

    def __init__(self, manifest: Manifest, precisions: list[str], *, verify: str = "first",
                 read_threads: int = 0, chunk_bytes: int = 8 << 20):
        if verify not in ("first", "always"):
            raise ValueError(f"verify: expected 'first' or 'always', got {verify!r}")
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or not 0 <= read_threads <= 64:
            raise ValueError(f"read_threads: expected an int in [0, 64], got {read_threads!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % BLOB_ALIGN:
            raise ValueError(f"chunk_bytes: expected a positive multiple of {BLOB_ALIGN} (4 KiB), got {chunk_bytes!r}")
        self.manifest = manifest
        self.verify = verify
        self.read_threads = read_threads
        self.chunk_bytes = chunk_bytes
        self._verified: dict[str, set[tuple[ExpertKey, str]]] = {}  # file -> blobs checked since it last changed
        self._stamps: dict[str, tuple[int, ...]] = {}  # file -> its stamp (_stamp) when last seen
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
        # The chunk threads only ever run _pread_full: they never call read, so they never wait on
        # the pool themselves. The thread-local mark makes a read that does arrive on one of them
        # (a caller handing store.read to our own pool) run inline instead of deadlocking.
        self._in_pool = threading.local()
        self._pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(read_threads, thread_name_prefix="tiers-disk-chunk", initializer=self._mark_pool_thread)
            if read_threads else None
        )

    def _mark_pool_thread(self) -> None:
        self._in_pool.active = True

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                fd = os.open(self.manifest.root / rel, os.O_RDONLY)
                self._fds[rel] = fd
                self._stamps[rel] = _stamp(fd)
                self._verified[rel] = set()
            return fd

    def _seen(self, rel: str, stamp: tuple[int, ...]) -> None:
        """Record ``rel``'s ``stamp``; if it is new, the file's blobs count as unchecked."""
        with self._lock:
            if self._stamps[rel] != stamp:
                self._stamps[rel] = stamp
                self._verified[rel] = set()

    def read(self, key: ExpertKey, precision: str, out: torch.Tensor) -> BlobRef:
        """Read one blob into the uint8 CPU tensor ``out`` (at least ``nbytes`` long)."""
        ref = self.manifest.ref(key, precision)
        path = self.manifest.root / ref.file
        if out.numel() < ref.nbytes:
            raise ValueError(f"read of {key} ({precision}): out holds {out.numel()} bytes, the blob needs {ref.nbytes}")
        dst = out[: ref.nbytes]
        assert dst.device.type == "cpu" and dst.dtype == torch.uint8 and dst.is_contiguous()
        view = memoryview(dst.numpy())
        tag = (key, precision)
        try:
            fd = self._fd(ref.file)
        except FileNotFoundError:
            raise IntegrityError(f"expert file {str(path)!r} is missing ({key}, {precision})") from None
        with self._lock:
            seen = self._stamps[ref.file]
            check = self.verify == "always" or tag not in self._verified[ref.file]
        got, crc = self._read_span(fd, view, ref.offset, check, 0)
        if got != ref.nbytes:
            raise IntegrityError(f"expert file {str(path)!r} is truncated: read {got} of {ref.nbytes} bytes for {key} ({precision})")
        # Stamped after the read: a write this read saw had updated the ctime before its bytes were
        # visible (the kernel stamps a write, and a write through a mapping, before it lands). One
        # fstat, about a microsecond against the blob's read.
        stamp = _stamp(fd)
        if stamp != seen:
            self._seen(ref.file, stamp)
            if not check:  # the file changed since this blob was checked: check what was read
                check, crc = True, zlib.crc32(view)
        if check:
            if crc != ref.crc32:
                raise IntegrityError(
                    f"checksum mismatch in {str(path)!r} for {key} ({precision}) at offset {ref.offset}: "
                    f"crc32 {crc:#010x}, manifest says {ref.crc32:#010x}; the file is corrupt, re-pack it"
                )
            with self._lock:
                if self._stamps[ref.file] == stamp:  # checked against the file as it is now
                    self._verified[ref.file].add(tag)
        return ref

    def _read_span(self, fd: int, view: memoryview, offset: int, check: bool, crc: int) -> tuple[int, int]:
        """Read ``view`` from ``offset`` (in chunks on the pool when long); the contiguous bytes read
        from the start, and the CRC32 continued from ``crc`` over them (``crc`` unchanged without ``check``)."""
        if not len(view):
            return 0, crc
        pool = self._pool
        if pool is None or len(view) <= self.chunk_bytes or getattr(self._in_pool, "active", False):
            got = _pread_full(fd, view, offset)
            return got, (zlib.crc32(view[:got], crc) if check else crc)
        return self._read_chunks(pool, fd, view, offset, check, crc)

    def _read_chunks(self, pool: ThreadPoolExecutor, fd: int, view: memoryview, offset: int, check: bool, crc: int) -> tuple[int, int]:
        """Read ``view`` from ``offset`` in chunks on the pool; the contiguous bytes read from the start, and their CRC32 continued from ``crc``.

        The CRC runs on this thread, chunk by chunk in file order, while later chunks are still being
        read. Every chunk is waited for before returning or raising (the invariant in the module doc).
        """
        c = self.chunk_bytes
        futures: list[Future] = [pool.submit(_pread_full, fd, view[s : s + c], offset + s) for s in range(0, len(view), c)]
        try:
            got = 0
            for i, f in enumerate(futures):
                n = f.result()
                if check:
                    crc = zlib.crc32(view[i * c : i * c + n], crc)
                got += n
                if n < min(c, len(view) - i * c):  # short: the file ends inside this chunk
                    break
            return got, crc
        finally:
            wait(futures)

    def close(self) -> None:
        """Close the files and stop the chunk threads; a later ``read`` reopens files and reads inline."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
