"""tiers-coldread: cold-read bandwidth of DiskStore against the disk's O_DIRECT rate, in one run.

    python tools/coldread.py PACKED_DIR [--precision int8] [--threads 4] [--read-threads 1] [--limit-gb 4]
                             [--request-mib 8] [--rounds 1] [--out result.json]

Owns the cold-read measurement. Invariant: every pass reads the same expert blobs (of one
precision, in file order, up to a byte limit) and starts right after the page cache of their
files was dropped, with the bytes still cached reported beside it. The passes (arms):

- ``o_direct_single``: one stream of O_DIRECT preadv requests of up to ``request_bytes`` (8 MiB)
  over each blob's whole stride, into a page-aligned mmap buffer;
- ``o_direct_threads``: the same requests on ``threads`` concurrent streams (when ``threads`` > 1);
- ``diskstore``: ``DiskStore.read`` (the engine's path, CRC32 verified on first read) with
  ``read_threads`` (default 1) and ``chunk_bytes=request_bytes``, into a page-aligned buffer faulted
  in before the clock starts (the engine reads into a pinned ring, faulted in at load);
- ``diskstore_serial``: the same with ``read_threads=0`` (when ``read_threads`` > 0);
- ``diskstore_parallel``: ``DiskStore.read`` of ``threads`` blobs at once, each into its own
  buffer, as the engine reads a layer call's cold misses on its reader threads (when ``threads`` > 1);

Each round runs every arm once, odd rounds in reverse order (``order`` lists them). ``ratio`` is
``diskstore.gbps`` over the best O_DIRECT rate (one blob at a time: a lone demand miss), and
``ratio_parallel`` the same for ``diskstore_parallel`` (several cold misses of one call), rates
being total bytes over total seconds; ``ratio_engine`` is the one of the path the engine takes
for blobs of this size (``engine_path``: together up to ``tiers.slots.Slots.PARALLEL_READ_BYTES``), and
``meets_target`` says whether it reaches the target, 0.9. GB/s are 1e9 bytes per second. Where the filesystem refuses O_DIRECT
(tmpfs before Linux 6.6: EINVAL), ``o_direct_supported`` is false, ``o_direct_error`` says why,
the O_DIRECT arms and ``ratio`` are null, and DiskStore is still measured.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import ctypes  # noqa: E402
import errno  # noqa: E402
import json  # noqa: E402
import mmap  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from tiers.loader.layout import ExpertKey  # noqa: E402
from tiers.loader.packed import Manifest, read_manifest  # noqa: E402
from tiers.store.disk_store import DiskStore, IntegrityError, drop_page_cache  # noqa: E402

REQUEST_BYTES = 8 << 20  # one O_DIRECT request, and DiskStore's chunk
# DiskStore's chunk threads by default: on the H200 test machine's virtio disk (read_ahead_kb 8192),
# one chunk thread (reading while the caller checks CRC32s) read 1.79 GB/s, two 1.39 and four 1.33;
# concurrent buffered preads on one descriptor share its readahead state and defeat it.
READ_THREADS = 1
TARGET_RATIO = 0.9
PAGE = mmap.PAGESIZE


class DirectIOUnsupported(OSError):
    pass


@dataclass(frozen=True)
class Span:
    """One expert blob on disk: ``nbytes`` of payload in a ``stride`` (4 KiB multiple) starting at a 4 KiB aligned ``offset``."""

    key: ExpertKey
    path: Path
    offset: int
    nbytes: int
    stride: int


def select_blobs(manifest: Manifest, precision: str, limit_bytes: int | None) -> list[Span]:
    """The blobs of ``precision`` in file order, as many as fit ``limit_bytes`` of strides (at least one)."""
    spans = []
    for key in manifest.keys:
        ref = manifest.ref(key, precision)
        spans.append(Span(key, manifest.root / ref.file, ref.offset, ref.nbytes, manifest.blob(key, precision).stride))
    spans.sort(key=lambda s: (str(s.path), s.offset))
    if limit_bytes is None:
        return spans
    picked, total = [], 0
    for s in spans:
        if picked and total + s.stride > limit_bytes:
            break
        picked.append(s)
        total += s.stride
    return picked


def open_direct(path: Path) -> int:
    """An O_DIRECT read-only descriptor; DirectIOUnsupported where the platform or filesystem refuses it."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        raise DirectIOUnsupported(errno.EINVAL, f"O_DIRECT does not exist on this platform ({sys.platform})")
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            raise DirectIOUnsupported(e.errno, f"the filesystem of {str(path)!r} refuses O_DIRECT: {e.strerror}") from None
        raise


def probe_direct(path: Path) -> str | None:
    """None if one aligned O_DIRECT read of ``path`` works, else why not (some filesystems accept the open and refuse the read)."""
    try:
        fd = open_direct(path)
    except DirectIOUnsupported as e:
        return e.strerror
    buf = mmap.mmap(-1, PAGE)
    try:
        os.preadv(fd, [buf], 0)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return f"the filesystem of {str(path)!r} refuses O_DIRECT reads: {e.strerror}"
        raise
    finally:
        os.close(fd)
        buf.close()
    return None


def cached_bytes(spans: list[Span]) -> int | None:
    """Bytes of the spans' strides now in the page cache (mincore over a mapping of each file); None where it cannot be asked."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    total = 0
    for path in sorted({s.path for s in spans}):
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                for s in spans:
                    if s.path == path:
                        first, end = s.offset // PAGE, min(-(-(s.offset + s.stride) // PAGE), len(vec))
                        total += PAGE * sum(vec[i] & 1 for i in range(first, end))
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def _rate(nbytes: int, seconds: float, **extra) -> dict:
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9 if seconds > 0 else None, **extra}


def direct_pass(spans: list[Span], streams: int, request_bytes: int, bar) -> dict:
    """Read every span's whole stride with O_DIRECT on ``streams`` threads; bytes read and time."""
    requests = queue.SimpleQueue()  # (fd, offset, length, last request of its blob)
    fds = {p: open_direct(p) for p in sorted({s.path for s in spans})}
    for s in spans:
        for k in range(0, s.stride, request_bytes):
            requests.put((fds[s.path], s.offset + k, min(request_bytes, s.stride - k), k + request_bytes >= s.stride))
    bufs = [mmap.mmap(-1, request_bytes) for _ in range(streams)]  # page-aligned, as O_DIRECT needs
    done = [0] * streams
    errors: list[BaseException] = []
    bar_lock = threading.Lock()

    def stream(i: int) -> None:
        view = memoryview(bufs[i])
        try:
            while True:
                try:
                    fd, off, n, last = requests.get_nowait()
                except queue.Empty:
                    return
                done[i] += os.preadv(fd, [view[:n]], off)  # one request; short only at the end of a file
                if last:
                    with bar_lock:
                        bar.update(1)
        except BaseException as e:  # surfaced on the calling thread below
            errors.append(e)
        finally:
            view.release()

    try:
        t0 = time.perf_counter()
        if streams == 1:
            stream(0)
        else:
            threads = [threading.Thread(target=stream, args=(i,), name=f"coldread-{i}") for i in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        seconds = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
        for b in bufs:
            b.close()
    if errors:
        raise errors[0]
    return _rate(sum(done), seconds, streams=streams, request_bytes=request_bytes)


def diskstore_pass(manifest: Manifest, precision: str, spans: list[Span], read_threads: int, chunk_bytes: int, bar) -> dict:
    """Read every span with DiskStore.read (verified on first read) into one page-aligned buffer; bytes and time."""
    store = DiskStore(manifest, [precision], verify="first", read_threads=read_threads, chunk_bytes=chunk_bytes)
    buf = mmap.mmap(-1, max(s.stride for s in spans))  # page-aligned with a stride of room, like the engine's ring buffers
    out = torch.frombuffer(buf, dtype=torch.uint8)  # [max stride]
    out.zero_()  # faulted in before the clock starts, as the engine's pinned ring is at load
    try:
        t0 = time.perf_counter()
        for s in spans:
            store.read(s.key, precision, out)
            bar.update(1)
        seconds = time.perf_counter() - t0
    finally:
        store.close()
        del out  # release the buffer export before closing the mapping
        buf.close()
    return _rate(sum(s.nbytes for s in spans), seconds, read_threads=read_threads, chunk_bytes=chunk_bytes, verify="first")


def diskstore_parallel_pass(manifest: Manifest, precision: str, spans: list[Span], workers: int, read_threads: int,
                            chunk_bytes: int, bar) -> dict:
    """Read every span with DiskStore.read, ``workers`` at a time, each worker into its own page-aligned buffer."""
    from concurrent.futures import ThreadPoolExecutor

    store = DiskStore(manifest, [precision], verify="first", read_threads=read_threads, chunk_bytes=chunk_bytes)
    size = max(s.stride for s in spans)
    free = queue.SimpleQueue()  # one buffer per worker: page-aligned and faulted in, like the engine's ring buffers
    for _ in range(workers):
        free.put(torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8).zero_())
    lock = threading.Lock()

    def read(span: Span) -> None:
        out = free.get()
        try:
            store.read(span.key, precision, out)
        finally:
            free.put(out)
        with lock:
            bar.update(1)

    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="coldread") as pool:
            t0 = time.perf_counter()
            for f in [pool.submit(read, s) for s in spans]:
                f.result()
            seconds = time.perf_counter() - t0
    finally:
        store.close()
    return _rate(sum(s.nbytes for s in spans), seconds, workers=workers, read_threads=read_threads, chunk_bytes=chunk_bytes, verify="first")


def measure(packed_dir, precision: str = "int8", *, threads: int = 4, read_threads: int = READ_THREADS,
            limit_bytes: int | None = None, request_bytes: int = REQUEST_BYTES, rounds: int = 1,
            progress: bool = True) -> dict:
    """Measure cold reads of ``precision``'s expert blobs in ``packed_dir`` (see the module doc); the result as a JSON-able dict.

    ``threads``: O_DIRECT streams; ``read_threads``: DiskStore's chunk threads. Each arm's
    ``bytes`` and ``seconds`` are totals over ``rounds``; ``rounds_gbps`` lists each round's rate.
    """
    manifest = read_manifest(packed_dir)
    if precision not in manifest.precisions:
        raise ValueError(f"precision {precision!r} is not packed in {str(manifest.root)!r} (it has {', '.join(manifest.precisions)})")
    for name, value, lo in (("threads", threads, 1), ("read_threads", read_threads, 0), ("rounds", rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= 64:
            raise ValueError(f"{name}: expected an int in [{lo}, 64], got {value!r}")
    if isinstance(request_bytes, bool) or not isinstance(request_bytes, int) or request_bytes <= 0 or request_bytes % PAGE:
        raise ValueError(f"request_bytes: expected a positive multiple of the page size ({PAGE}), got {request_bytes!r}")
    if limit_bytes is not None and limit_bytes <= 0:
        raise ValueError(f"limit_bytes: expected a positive number of bytes, got {limit_bytes!r}")
    spans = select_blobs(manifest, precision, limit_bytes)
    if not spans:
        raise ValueError(f"{str(manifest.root)!r} holds no expert blobs")
    files = sorted({s.path for s in spans})
    error = probe_direct(files[0])
    result = {
        "packed_dir": str(manifest.root), "precision": precision, "blobs": len(spans), "files": len(files),
        "stride_bytes": sum(s.stride for s in spans), "blob_bytes": sum(s.nbytes for s in spans),
        "threads": threads, "read_threads": read_threads, "request_bytes": request_bytes, "rounds": rounds,
        "o_direct_supported": error is None, "o_direct_error": error,
    }
    arms = {}  # name -> (progress label, one pass over the spans: bar -> rate dict)
    if error is None:
        arms["o_direct_single"] = ("O_DIRECT, 1 stream", lambda bar: direct_pass(spans, 1, request_bytes, bar))
        if threads > 1:
            arms["o_direct_threads"] = (f"O_DIRECT, {threads} streams", lambda bar: direct_pass(spans, threads, request_bytes, bar))
    arms["diskstore"] = (f"DiskStore, read_threads={read_threads}",
                         lambda bar: diskstore_pass(manifest, precision, spans, read_threads, request_bytes, bar))
    if read_threads:
        arms["diskstore_serial"] = ("DiskStore, read_threads=0",
                                    lambda bar: diskstore_pass(manifest, precision, spans, 0, request_bytes, bar))
    if threads > 1:
        arms["diskstore_parallel"] = (f"DiskStore, {threads} blobs at once",
                                      lambda bar: diskstore_parallel_pass(manifest, precision, spans, threads, read_threads, request_bytes, bar))
    # Rounds alternate the order (ABBA...): a disk whose rate drifts during the run (burst credits,
    # host-side caches) then biases no arm, where one fixed order would favour whichever runs first.
    order = [list(arms) if r % 2 == 0 else list(arms)[::-1] for r in range(rounds)]
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    drops = []
    with tqdm(total=rounds * len(arms) * len(spans), desc="cold reads", unit="blob", disable=not progress) as bar:
        for names in order:
            for name in names:
                label, run = arms[name]
                drops.append(drop_page_cache(files))  # before every pass; O_DIRECT would not need it, the others do
                cached = cached_bytes(spans)
                bar.set_postfix_str(label)
                runs[name].append(run(bar) | {"cached_bytes_before": cached})
    for name in ("o_direct_single", "o_direct_threads", "diskstore", "diskstore_serial", "diskstore_parallel"):
        result[name] = _total(runs[name]) if name in runs else None
    result["order"] = order
    result["page_cache_dropped"] = all(drops)
    best = max((result[n]["gbps"] for n in ("o_direct_single", "o_direct_threads") if result[n]), default=None)
    result["o_direct_best_gbps"] = best
    for suffix in ("", "_parallel"):  # each DiskStore arm
        arm = result[f"diskstore{suffix}"]
        result[f"ratio{suffix}"] = arm["gbps"] / best if best and arm and arm["gbps"] else None
    # the engine reads a call's cold misses together only when their blobs are small
    from tiers.slots import Slots

    blob = max((s.nbytes for s in spans), default=0)
    result["engine_path"] = "diskstore_parallel" if blob <= Slots.PARALLEL_READ_BYTES and threads > 1 else "diskstore"
    result["ratio_engine"] = result["ratio_parallel"] if result["engine_path"] == "diskstore_parallel" else result["ratio"]
    result["target_ratio"] = TARGET_RATIO
    # the target holds the path the engine takes for these blobs to the disk's best O_DIRECT rate
    result["meets_target"] = None if result["ratio_engine"] is None else result["ratio_engine"] >= TARGET_RATIO
    return result


def _total(runs: list[dict]) -> dict:
    """One arm over all rounds: total bytes and seconds, each round's rate, the most bytes found cached before a pass."""
    nbytes, seconds = sum(r["bytes"] for r in runs), sum(r["seconds"] for r in runs)
    cached = [r["cached_bytes_before"] for r in runs]
    settings = {k: v for k, v in runs[0].items() if k not in ("bytes", "seconds", "gbps", "cached_bytes_before")}
    return _rate(nbytes, seconds, **settings, rounds_gbps=[r["gbps"] for r in runs],
                 cached_bytes_before=None if None in cached else max(cached))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tiers-coldread", description=__doc__.splitlines()[0])
    ap.add_argument("packed", help="a directory written by tools/pack.py")
    ap.add_argument("--precision", default="int8", help="which packed precision's blobs to read (default int8)")
    ap.add_argument("--threads", type=int, default=4, help="O_DIRECT streams (default 4)")
    ap.add_argument("--read-threads", type=int, default=READ_THREADS, help=f"DiskStore read_threads (default {READ_THREADS})")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every pass, alternating the order (default 1)")
    ap.add_argument("--limit-gb", type=float, default=4.0, help="read at most this many GB (1e9 bytes) of blobs (default 4)")
    ap.add_argument("--request-mib", type=int, default=REQUEST_BYTES >> 20,
                    help="O_DIRECT request size and DiskStore chunk size, in MiB (default 8)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        result = measure(args.packed, args.precision, threads=args.threads, read_threads=args.read_threads,
                         limit_bytes=int(args.limit_gb * 1e9), request_bytes=args.request_mib << 20,
                         rounds=args.rounds, progress=not args.quiet)
    except (ValueError, IntegrityError) as e:
        print(f"tiers-coldread: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
