"""DiskStore with direct_io: the whole pages of an aligned blob come with O_DIRECT into a
page-aligned buffer, the last partial page buffered; the bytes equal a buffered read, integrity
failures in either part still raise, and a platform or filesystem that refuses O_DIRECT (at open
or at the first read) leaves the store reading buffered, correctly."""
from __future__ import annotations

import errno
import mmap
import os

import pytest
import torch

from conftest import flip_byte
from test_disk_store_parallel import PRECISIONS, file_bytes, packed, packed_copy  # noqa: F401 (fixtures)
from tiers.loader.blob import BLOB_ALIGN
from tiers.loader.packed import read_manifest
from tiers.store import disk_store
from tiers.store.disk_store import DiskStore, IntegrityError

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


def aligned_buffer(nbytes: int, shift: int = 0) -> torch.Tensor:
    """A uint8 tensor in its own page-aligned mapping, starting ``shift`` bytes in."""
    buf = mmap.mmap(-1, nbytes + BLOB_ALIGN)
    return torch.frombuffer(buf, dtype=torch.uint8)[shift : shift + nbytes]


def _direct_supported(root) -> bool:
    """Whether the test filesystem takes O_DIRECT reads, asked independently of DiskStore: one
    aligned O_DIRECT read of a page (some filesystems accept the open and refuse the read)."""
    m = read_manifest(root)
    try:
        fd = os.open(root / m.ref(m.keys[0], "bf16").file, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    buf = mmap.mmap(-1, BLOB_ALIGN)
    try:
        os.preadv(fd, [buf], 0)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.close(fd)
        buf.close()
    return True


@pytest.mark.parametrize("read_threads", [0, 2])
def test_direct_reads_equal_the_file(packed, read_threads):  # noqa: F811
    if not _direct_supported(packed):
        pytest.skip("the test filesystem refuses O_DIRECT")
    m = read_manifest(packed)
    store = DiskStore(m, PRECISIONS, direct_io=True, read_threads=read_threads, chunk_bytes=2 * BLOB_ALIGN)
    opened = []
    real_open = os.open
    checked = 0
    try:
        os.open = lambda path, flags, *a: opened.append(flags) or real_open(path, flags, *a)
        for key in m.keys:
            for p in PRECISIONS:
                ref = m.ref(key, p)
                out = aligned_buffer(ref.nbytes)
                store.read(key, p, out)
                assert torch.equal(out, file_bytes(packed, key, p)), f"{key} {p}"
                checked += ref.nbytes >= BLOB_ALIGN
    finally:
        os.open = real_open
        store.close()
    assert checked and store.direct_io_active is True
    assert any(f & os.O_DIRECT for f in opened), "the bulk of the blobs must come with O_DIRECT"


def test_an_unaligned_buffer_reads_buffered(packed):  # noqa: F811
    m = read_manifest(packed)
    store = DiskStore(m, PRECISIONS, direct_io=True)
    key = m.keys[1]
    out = aligned_buffer(m.ref(key, "int8").nbytes, shift=8)
    store.read(key, "int8", out)
    assert torch.equal(out, file_bytes(packed, key, "int8")) and not store._dfds
    store.close()


@pytest.mark.parametrize("where", ["bulk", "tail"])
def test_a_corrupt_byte_in_either_part_raises(packed_copy, where):  # noqa: F811
    if not _direct_supported(packed_copy):
        pytest.skip("the test filesystem refuses O_DIRECT")
    m = read_manifest(packed_copy)
    key = m.keys[2]
    ref = m.ref(key, "int8")
    assert ref.nbytes % BLOB_ALIGN, "the blob must end in a partial page"
    at = 100 if where == "bulk" else ref.nbytes - 3
    flip_byte(packed_copy / ref.file, ref.offset + at)
    store = DiskStore(m, PRECISIONS, direct_io=True, read_threads=2, chunk_bytes=BLOB_ALIGN)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        store.read(key, "int8", aligned_buffer(ref.nbytes))
    store.close()


@pytest.mark.parametrize("refused_at", ["open", "read"])
def test_a_refused_o_direct_falls_back_to_buffered_reads(packed, monkeypatch, refused_at):  # noqa: F811
    m = read_manifest(packed)
    store = DiskStore(m, PRECISIONS, direct_io=True, read_threads=2, chunk_bytes=BLOB_ALIGN)
    real_open, real_pread = os.open, disk_store._pread_full

    def refuse_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "refused")
        return real_open(path, flags, *a)

    def refuse_read(fd, view, offset):
        if fd in store._dfds.values():
            raise OSError(errno.EINVAL, "refused")
        return real_pread(fd, view, offset)

    if refused_at == "open":
        monkeypatch.setattr(os, "open", refuse_open)
    else:
        monkeypatch.setattr(disk_store, "_pread_full", refuse_read)
    for key in m.keys[:3]:
        for p in PRECISIONS:
            out = aligned_buffer(m.ref(key, p).nbytes)
            store.read(key, p, out)
            assert torch.equal(out, file_bytes(packed, key, p)), f"{key} {p}"
    assert store.direct_io_active is False
    store.close()


def test_direct_io_must_be_a_bool(packed):  # noqa: F811
    with pytest.raises(ValueError, match="direct_io"):
        DiskStore(read_manifest(packed), PRECISIONS, direct_io="yes")
