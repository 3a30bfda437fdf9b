"""DiskStore with read_threads: a blob read in chunks on the internal pool lands exactly the bytes of
a single pread, from any number of calling threads, and every integrity failure still raises
IntegrityError naming the file and the expert; drop_page_cache evicts without breaking reads."""
from __future__ import annotations

import math
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
import torch

from conftest import flip_byte
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.store import disk_store
from tiers.store.disk_store import DiskStore, IntegrityError, drop_page_cache

MODEL = "mixtral"  # bf16 blobs of 36 KiB (9 pages), int8 blobs of 19 KiB in a 20 KiB stride
PRECISIONS = ["bf16", "int8"]
SENTINEL = 0xA5


@pytest.fixture
def packed(packed_factory) -> Path:
    return packed_factory(MODEL, ("bf16", "int8"))


@pytest.fixture
def packed_copy(packed, tmp_path) -> Path:
    dst = tmp_path / "packed"
    shutil.copytree(packed, dst)
    return dst


def file_bytes(root: Path, key: ExpertKey, precision: str) -> torch.Tensor:
    ref = read_manifest(root).ref(key, precision)
    with open(root / ref.file, "rb") as f:
        f.seek(ref.offset)
        return torch.frombuffer(bytearray(f.read(ref.nbytes)), dtype=torch.uint8)


def single_reads(root: Path) -> dict[tuple[ExpertKey, str], torch.Tensor]:
    """Every blob as the single-threaded read gives it."""
    m = read_manifest(root)
    store = DiskStore(m, PRECISIONS)
    out = {}
    for key in m.keys:
        for p in PRECISIONS:
            buf = torch.empty(m.ref(key, p).nbytes, dtype=torch.uint8)
            store.read(key, p, buf)
            out[(key, p)] = buf
    store.close()
    return out


def sentinel_buffer(m, key: ExpertKey, precision: str) -> torch.Tensor:
    """A stride-sized destination, like the engine's ring buffers, pre-filled so overruns show."""
    return torch.full((m.blob(key, precision).stride,), SENTINEL, dtype=torch.uint8)


def assert_names(err: pytest.ExceptionInfo, path: Path, key: ExpertKey) -> None:
    msg = str(err.value)
    assert str(path) in msg, msg
    assert f"layer {key.layer} expert {key.expert}" in msg, msg


@pytest.fixture
def chunk_calls(monkeypatch) -> list[tuple[str, int, int]]:
    """Record every pread the store issues: (thread name, file offset, length)."""
    calls: list[tuple[str, int, int]] = []
    real = disk_store._pread_full

    def spy(fd, view, offset):
        calls.append((threading.current_thread().name, offset, len(view)))
        return real(fd, view, offset)

    monkeypatch.setattr(disk_store, "_pread_full", spy)
    return calls


# -- same bytes --------------------------------------------------------------------------------
# 4 KiB divides the bf16 blob (36 KiB) but not the int8 one (19 KiB); 8 KiB and 20 KiB divide neither.
@pytest.mark.parametrize("chunk_bytes", [4096, 8192, 20480])
@pytest.mark.parametrize("read_threads", [1, 3])
def test_chunked_read_equals_single_read(packed, chunk_bytes, read_threads, chunk_calls):
    m = read_manifest(packed)
    want = single_reads(packed)
    chunk_calls.clear()
    store = DiskStore(m, PRECISIONS, verify="always", read_threads=read_threads, chunk_bytes=chunk_bytes)
    for key in m.keys:
        for p in PRECISIONS:
            ref = m.ref(key, p)
            out = sentinel_buffer(m, key, p)
            chunk_calls.clear()
            assert store.read(key, p, out) == ref
            assert torch.equal(out[: ref.nbytes], want[(key, p)]), (key, p)
            assert torch.equal(out[: ref.nbytes], file_bytes(packed, key, p)), (key, p)
            assert bool((out[ref.nbytes:] == SENTINEL).all()), f"{key} {p}: bytes written past nbytes"
            n = math.ceil(ref.nbytes / chunk_bytes)
            expect = [(ref.offset + i * chunk_bytes, min(chunk_bytes, ref.nbytes - i * chunk_bytes)) for i in range(n)]
            if n == 1:  # fits one chunk: read inline on this thread
                assert chunk_calls == [(threading.current_thread().name, *expect[0])]
            else:
                assert sorted((o, ln) for _, o, ln in chunk_calls) == expect
                assert all(t.startswith("tiers-disk-chunk") for t, _, _ in chunk_calls), chunk_calls
    store.close()


def test_default_chunk_reads_a_small_blob_inline(packed, chunk_calls):
    m = read_manifest(packed)
    key = ExpertKey(0, 1)
    store = DiskStore(m, ["bf16"], read_threads=4)
    assert store.chunk_bytes == 8 << 20
    out = sentinel_buffer(m, key, "bf16")
    store.read(key, "bf16", out)
    ref = m.ref(key, "bf16")
    assert chunk_calls == [(threading.current_thread().name, ref.offset, ref.nbytes)]
    assert torch.equal(out[: ref.nbytes], file_bytes(packed, key, "bf16"))
    store.close()


# -- concurrency -------------------------------------------------------------------------------
def test_concurrent_callers_get_exact_bytes(packed):
    m = read_manifest(packed)
    want = single_reads(packed)
    store = DiskStore(m, PRECISIONS, verify="always", read_threads=2, chunk_bytes=4096)
    jobs = [(k, p) for k in m.keys for p in PRECISIONS]
    start = threading.Barrier(8)

    def caller(i: int) -> list[tuple[ExpertKey, str]]:
        start.wait()
        bad = []
        for key, p in jobs[i:] + jobs[:i]:  # each caller in a different order
            out = sentinel_buffer(m, key, p)
            store.read(key, p, out)
            n = m.ref(key, p).nbytes
            if not torch.equal(out[:n], want[(key, p)]) or not bool((out[n:] == SENTINEL).all()):
                bad.append((key, p))
        return bad

    with ThreadPoolExecutor(8) as callers:
        results = [f.result(timeout=30) for f in [callers.submit(caller, i * 5) for i in range(8)]]
    store.close()
    assert results == [[]] * 8


def test_read_called_from_a_chunk_thread_does_not_deadlock(packed):
    """With one chunk thread, a read issued on that thread must not wait on chunks queued behind itself."""
    m = read_manifest(packed)
    key = ExpertKey(2, 7)
    store = DiskStore(m, ["bf16"], read_threads=1, chunk_bytes=4096)
    out = sentinel_buffer(m, key, "bf16")
    fut = store._pool.submit(store.read, key, "bf16", out)
    try:
        fut.result(timeout=10)
    except FutureTimeout:
        store._pool.shutdown(wait=False, cancel_futures=True)  # unblock the stuck thread so pytest can exit
        pytest.fail("DiskStore.read deadlocked when called from one of its own chunk threads")
    ref = m.ref(key, "bf16")
    assert torch.equal(out[: ref.nbytes], file_bytes(packed, key, "bf16"))
    store.close()


# -- integrity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999999])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_chunked_corruption_raises_naming_file_and_expert(packed_copy, where, precision):
    m = read_manifest(packed_copy)
    key = ExpertKey(1, 4)
    ref = m.ref(key, precision)
    path = packed_copy / ref.file
    flip_byte(path, ref.offset + min(int(ref.nbytes * where), ref.nbytes - 1))
    store = DiskStore(m, PRECISIONS, read_threads=3, chunk_bytes=4096)
    with pytest.raises(IntegrityError, match="checksum") as ei:
        store.read(key, precision, sentinel_buffer(m, key, precision))
    assert_names(ei, path, key)
    neighbour = ExpertKey(1, 5)  # the rest of the file is still served, and exact
    out = sentinel_buffer(m, neighbour, precision)
    store.read(neighbour, precision, out)
    assert torch.equal(out[: m.ref(neighbour, precision).nbytes], file_bytes(packed_copy, neighbour, precision))
    store.close()


def test_chunked_read_of_file_truncated_after_open_raises(packed_copy):
    m = read_manifest(packed_copy)
    key = ExpertKey(0, 7)  # the file's last blob
    ref = m.ref(key, "bf16")
    path = packed_copy / ref.file
    store = DiskStore(m, ["bf16"], read_threads=2, chunk_bytes=8192)  # the size check passes here
    cut = ref.nbytes // 2 + 100  # inside a chunk, not on a boundary
    with open(path, "r+b") as f:
        f.truncate(ref.offset + cut)
    with pytest.raises(IntegrityError, match=f"truncated: read {cut} of {ref.nbytes} bytes") as ei:
        store.read(key, "bf16", sentinel_buffer(m, key, "bf16"))
    assert_names(ei, path, key)
    store.close()


def test_chunked_read_of_file_removed_after_open_raises(packed_copy):
    m = read_manifest(packed_copy)
    key = ExpertKey(2, 0)
    path = packed_copy / m.ref(key, "int8").file
    store = DiskStore(m, ["int8"], read_threads=2, chunk_bytes=4096)
    path.unlink()
    with pytest.raises(IntegrityError, match="missing") as ei:
        store.read(key, "int8", sentinel_buffer(m, key, "int8"))
    assert_names(ei, path, key)
    store.close()


# -- API boundary ----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"read_threads": -1}, "read_threads"), ({"read_threads": 1.5}, "read_threads"), ({"read_threads": True}, "read_threads"),
    ({"read_threads": 65}, "read_threads"),
    ({"chunk_bytes": 0}, "chunk_bytes"), ({"chunk_bytes": 1000}, "chunk_bytes"), ({"chunk_bytes": 4097}, "chunk_bytes"),
])
def test_bad_thread_and_chunk_settings_are_refused(packed, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: expected") as ei:
        DiskStore(read_manifest(packed), ["bf16"], **kwargs)
    assert repr(next(iter(kwargs.values()))) in str(ei.value)


def test_too_small_destination_is_refused_naming_the_expert(packed):
    m = read_manifest(packed)
    key = ExpertKey(1, 2)
    store = DiskStore(m, ["int8"], read_threads=2, chunk_bytes=4096)
    n = m.ref(key, "int8").nbytes
    with pytest.raises(ValueError, match=rf"layer 1 expert 2.*holds {n - 1} bytes, the blob needs {n}"):
        store.read(key, "int8", torch.empty(n - 1, dtype=torch.uint8))
    store.close()


def test_read_after_close_still_works_inline(packed, chunk_calls):
    m = read_manifest(packed)
    key = ExpertKey(0, 0)
    store = DiskStore(m, ["bf16"], read_threads=2, chunk_bytes=4096)
    store.close()
    store.close()  # idempotent
    out = sentinel_buffer(m, key, "bf16")
    store.read(key, "bf16", out)
    assert {t for t, _, _ in chunk_calls} == {threading.current_thread().name}
    assert torch.equal(out[: m.ref(key, "bf16").nbytes], file_bytes(packed, key, "bf16"))
    store.close()


# -- page cache --------------------------------------------------------------------------------
def test_drop_page_cache_then_reads_are_still_exact(packed):
    m = read_manifest(packed)
    files = sorted({m.root / m.ref(k, p).file for k in m.keys for p in PRECISIONS})
    want = single_reads(packed)
    dropped = drop_page_cache(files)
    assert dropped is (hasattr(os, "posix_fadvise"))
    store = DiskStore(m, PRECISIONS, verify="always", read_threads=2, chunk_bytes=8192)
    for (key, p), blob in want.items():
        out = sentinel_buffer(m, key, p)
        store.read(key, p, out)
        assert torch.equal(out[: blob.numel()], blob), (key, p)
    store.close()


def test_drop_page_cache_reports_what_it_could_not_do(packed, tmp_path, monkeypatch):
    real = next(iter(sorted((packed / "experts" / "int8").iterdir())))
    assert drop_page_cache([tmp_path / "no-such-file", real]) is False
    assert drop_page_cache([]) is (hasattr(os, "posix_fadvise"))
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    assert drop_page_cache([real]) is False
