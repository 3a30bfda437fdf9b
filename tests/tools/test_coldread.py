"""tools/coldread.py: one run measures O_DIRECT and DiskStore reads over the same blobs, after
dropping the page cache, and reports consistent byte counts, rates and their ratio."""
from __future__ import annotations

import errno
import json
import os
import resource
import shutil
from pathlib import Path

import pytest

from tiers.loader.packed import read_manifest
from tiers.store.disk_store import drop_page_cache
from tiers.tools import coldread

MODEL = "mixtral"
RATE_FIELDS = ("o_direct_single", "o_direct_threads", "diskstore", "diskstore_serial", "diskstore_parallel")


@pytest.fixture
def packed(packed_factory) -> Path:
    return packed_factory(MODEL, ("bf16", "int8"))


def sums(root: Path, precision: str) -> tuple[int, int, int]:
    m = read_manifest(root)
    return (len(m.keys), sum(m.blob(k, precision).stride for k in m.keys), sum(m.ref(k, precision).nbytes for k in m.keys))


def assert_rate(r: dict, nbytes: int) -> None:
    assert r["bytes"] == nbytes
    assert r["seconds"] > 0 and r["gbps"] > 0
    assert r["gbps"] == pytest.approx(nbytes / r["seconds"] / 1e9)


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_measure_counts_every_blob_once_per_pass(packed, precision):
    blobs, strides, nbytes = sums(packed, precision)
    r = coldread.measure(packed, precision, threads=2, read_threads=2, progress=False)
    assert (r["blobs"], r["stride_bytes"], r["blob_bytes"]) == (blobs, strides, nbytes)
    assert r["o_direct_supported"] is True, r["o_direct_error"]  # tmp_path is a disk filesystem here
    assert_rate(r["o_direct_single"], strides)  # O_DIRECT reads whole strides
    assert_rate(r["o_direct_threads"], strides)
    assert r["o_direct_threads"]["streams"] == 2
    assert_rate(r["diskstore"], nbytes)  # DiskStore reads the payload
    assert_rate(r["diskstore_serial"], nbytes)
    assert (r["diskstore"]["read_threads"], r["diskstore_serial"]["read_threads"]) == (2, 0)
    best = max(r["o_direct_single"]["gbps"], r["o_direct_threads"]["gbps"])
    assert r["o_direct_best_gbps"] == best
    assert r["ratio"] == pytest.approx(r["diskstore"]["gbps"] / best)
    assert_rate(r["diskstore_parallel"], nbytes)  # several blobs at once, as a call's cold misses are read
    assert r["diskstore_parallel"]["workers"] == 2
    assert r["ratio_parallel"] == pytest.approx(r["diskstore_parallel"]["gbps"] / best)
    assert (r["engine_path"], r["ratio_engine"]) == ("diskstore_parallel", r["ratio_parallel"])  # tiny blobs: read together
    assert r["meets_target"] is (r["ratio_engine"] >= 0.9)  # the engine's path is what the target holds
    assert "diskstore_direct" not in r  # the store reads buffered only
    assert r["page_cache_dropped"] is hasattr(os, "posix_fadvise")
    json.dumps(r)  # JSON-able as it stands


def test_small_requests_split_strides_and_chunks_without_losing_bytes(packed):
    _, strides, nbytes = sums(packed, "int8")  # a 20 KiB stride is 8 + 8 + 4 KiB requests
    r = coldread.measure(packed, "int8", threads=3, request_bytes=8192, progress=False)
    assert r["o_direct_single"]["bytes"] == r["o_direct_threads"]["bytes"] == strides
    assert r["diskstore"]["bytes"] == nbytes and r["diskstore"]["chunk_bytes"] == 8192


def test_rounds_alternate_the_order_and_add_up(packed):
    _, strides, nbytes = sums(packed, "int8")
    r = coldread.measure(packed, "int8", threads=2, read_threads=1, rounds=3, progress=False)
    arms = ["o_direct_single", "o_direct_threads", "diskstore", "diskstore_serial", "diskstore_parallel"]
    assert r["order"] == [arms, arms[::-1], arms]
    for name, per_round in zip(arms, [strides, strides, nbytes, nbytes, nbytes]):
        assert_rate(r[name], 3 * per_round)
        assert len(r[name]["rounds_gbps"]) == 3 and all(g > 0 for g in r[name]["rounds_gbps"])
    assert (r["diskstore"]["read_threads"], r["diskstore_serial"]["read_threads"]) == (1, 0)
    assert r["o_direct_threads"]["streams"] == 2


def test_read_threads_zero_has_no_serial_twin(packed):
    r = coldread.measure(packed, "int8", threads=2, read_threads=0, progress=False)
    assert r["diskstore"]["read_threads"] == 0 and r["diskstore_serial"] is None
    assert r["order"] == [["o_direct_single", "o_direct_threads", "diskstore", "diskstore_parallel"]]


def test_limit_bytes_picks_whole_blobs_in_file_order(packed):
    m = read_manifest(packed)
    stride = m.blob(m.keys[0], "int8").stride
    spans = coldread.select_blobs(m, "int8", 3 * stride + 1)
    assert len(spans) == 3
    assert [(s.path, s.offset) for s in spans] == sorted((s.path, s.offset) for s in coldread.select_blobs(m, "int8", None))[:3]
    assert len(coldread.select_blobs(m, "int8", 1)) == 1  # at least one blob
    r = coldread.measure(packed, "int8", threads=1, limit_bytes=3 * stride + 1, progress=False)
    assert r["blobs"] == 3 and r["o_direct_single"]["bytes"] == 3 * stride
    assert r["o_direct_threads"] is None  # one thread: the single stream is the only O_DIRECT pass
    assert r["diskstore_parallel"] is None and r["ratio_parallel"] is None
    assert (r["engine_path"], r["ratio_engine"]) == ("diskstore", r["ratio"])


def test_dropped_cache_is_really_empty(packed):
    m = read_manifest(packed)
    spans = coldread.select_blobs(m, "bf16", None)
    for path in {s.path for s in spans}:
        path.read_bytes()  # warm
    warm = coldread.cached_bytes(spans)
    if warm is None:
        pytest.skip("mincore is not available on this platform")
    assert warm == sum(s.stride for s in spans)
    if not drop_page_cache({s.path for s in spans}):
        pytest.skip("posix_fadvise is not available on this platform")
    assert coldread.cached_bytes(spans) == 0
    r = coldread.measure(packed, "bf16", threads=2, progress=False)
    assert r["o_direct_single"]["cached_bytes_before"] == 0
    assert r["diskstore"]["cached_bytes_before"] == r["diskstore_serial"]["cached_bytes_before"] == 0


def _check_unsupported(r: dict, root: Path) -> None:
    _, _, nbytes = sums(root, "int8")
    assert r["o_direct_supported"] is False
    assert "O_DIRECT" in r["o_direct_error"] and str(root) in r["o_direct_error"]
    assert r["o_direct_single"] is None and r["o_direct_threads"] is None
    assert r["ratio"] is None and r["meets_target"] is None and r["o_direct_best_gbps"] is None
    assert r["ratio_parallel"] is None
    assert_rate(r["diskstore"], nbytes)  # DiskStore is still measured


def test_o_direct_refused_is_reported_not_raised(packed, monkeypatch):
    def refuse(path):
        raise coldread.DirectIOUnsupported(errno.EINVAL, f"the filesystem of {str(path)!r} refuses O_DIRECT: Invalid argument")

    monkeypatch.setattr(coldread, "open_direct", refuse)
    _check_unsupported(coldread.measure(packed, "int8", threads=2, progress=False), packed)


def test_o_direct_on_tmpfs_is_reported_not_raised(packed):
    shm = Path("/dev/shm")
    if not shm.is_dir() or not hasattr(os, "O_DIRECT"):
        pytest.skip("no /dev/shm or no O_DIRECT here")
    dst = shm / f"tiers-coldread-test-{os.getpid()}"
    shutil.copytree(packed, dst, ignore=shutil.ignore_patterns("dense-*", "bf16"))
    try:
        try:
            os.close(os.open(dst / "manifest.json", os.O_RDONLY | os.O_DIRECT))
            pytest.skip("this kernel's /dev/shm accepts O_DIRECT (tmpfs does since Linux 6.6)")
        except OSError:
            pass
        spans = coldread.select_blobs(read_manifest(dst), "int8", None)
        assert coldread.probe_direct(spans[0].path) is not None
        _check_unsupported(coldread.measure(dst, "int8", threads=2, progress=False), dst)
    finally:
        shutil.rmtree(dst)


# -- CLI -------------------------------------------------------------------------------------
def test_main_prints_and_writes_json(packed, tmp_path, capsys):
    out = tmp_path / "coldread.json"
    rc = coldread.main([str(packed), "--threads", "2", "--quiet", "--limit-gb", "0.0001", "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    printed = json.loads(stdout)
    assert json.loads(out.read_text()) == printed
    m = read_manifest(packed)
    stride = m.blob(m.keys[0], "int8").stride
    assert printed["blobs"] == 100_000 // stride  # --limit-gb 0.0001 is 1e5 bytes of whole strides
    assert printed["precision"] == "int8" and printed["threads"] == 2 and printed["read_threads"] == coldread.READ_THREADS
    assert set(RATE_FIELDS) <= set(printed) and "ratio" in printed and "o_direct_supported" in printed


@pytest.mark.parametrize("args, needle", [
    (["--precision", "bnb8"], "precision 'bnb8' is not packed"),
    (["--threads", "0"], "threads: expected an int in [1, 64], got 0"),
    (["--read-threads", "-1"], "read_threads: expected an int in [0, 64], got -1"),
    (["--rounds", "0"], "rounds: expected an int in [1, 64], got 0"),
    (["--limit-gb", "0"], "limit_bytes: expected a positive number"),
    (["--request-mib", "0"], "request_bytes: expected a positive multiple"),
])
def test_main_reports_bad_arguments(packed, capsys, args, needle):
    rc = coldread.main([str(packed), "--quiet", *args])
    _, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("tiers-coldread: error:") and needle in err, err
    assert "Traceback" not in err


def test_main_on_a_directory_that_is_not_packed(tmp_path, capsys):
    rc = coldread.main([str(tmp_path), "--quiet"])
    _, err = capsys.readouterr()
    assert rc == 2 and str(tmp_path) in err and "not a packed checkpoint" in err


@pytest.mark.parametrize("workers", [1, 3])
def test_diskstore_passes_read_into_buffers_faulted_before_the_clock(packed, monkeypatch, workers):
    """The DiskStore passes read into buffers made and touched before timing starts (as the
    engine's pinned ring is at load), one per worker, so page faults are not charged to the disk."""
    _, _, nbytes = sums(packed, "int8")
    manifest = read_manifest(packed)
    spans = coldread.select_blobs(manifest, "int8", None)
    faults: dict[int, tuple[int, int]] = {}  # buffer -> (page faults writing all of it at its first read, its pages)
    real_read = coldread.DiskStore.read

    def read(self, key, precision, out):
        if out.data_ptr() not in faults:
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            out.fill_(1)
            faults[out.data_ptr()] = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0, out.numel() // coldread.PAGE)
        return real_read(self, key, precision, out)

    monkeypatch.setattr(coldread.DiskStore, "read", read)

    class Bar:
        def update(self, n):
            pass

    if workers == 1:
        r = coldread.diskstore_pass(manifest, "int8", spans, 1, coldread.REQUEST_BYTES, Bar())
    else:
        r = coldread.diskstore_parallel_pass(manifest, "int8", spans, workers, 1, coldread.REQUEST_BYTES, Bar())
    assert r["bytes"] == nbytes
    assert 1 <= len(faults) <= workers
    for n, pages in faults.values():
        assert pages >= 4 and n <= pages // 4, f"{n} page faults writing a {pages}-page buffer: it was not touched before the clock"
