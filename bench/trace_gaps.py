"""Where the copy engine waits: idle gaps of one CUDA stream's copies in a chrome trace.

    python bench/trace_gaps.py TRACE.json.gz [--stream N] [--min-us 100]

Reads a trace written by ``bench/profile_arms.py --trace`` (torch.profiler's chrome format). Prints
each stream's copy and kernel busy time, the host ranges the engine names (``tiers.*``) with their
totals, and every gap of at least ``--min-us`` between copies on the copy stream (the stream with
the most copy time, unless ``--stream``): how long, how much of it some kernel ran, and which
host ranges began inside it. A gap where kernels ran little and the host was inside the engine
is host-bound; one covered by kernels is waiting on compute.
"""
import argparse
import collections
import gzip
import json
import sys


def union_us(spans: list[tuple[float, float]]) -> float:
    """Total time covered by (start, duration) spans."""
    total, end = 0.0, None
    start = 0.0
    for s, d in sorted(spans):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, s + d
        else:
            end = max(end, s + d)
    return total + (end - start if end is not None else 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--stream", type=int, help="the copy stream's id (default: the one with the most copy time)")
    ap.add_argument("--min-us", type=float, default=100.0)
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    if not device:
        print("no device events in the trace", file=sys.stderr)
        return 1
    t0 = min(e["ts"] for e in device)
    by_stream: dict[tuple[str, int], list[tuple[float, float]]] = collections.defaultdict(list)
    for e in device:
        by_stream[(e["cat"], e["args"].get("stream"))].append((e["ts"] - t0, e["dur"]))
    kernels = [s for (cat, _), spans in by_stream.items() if cat == "kernel" for s in spans]
    copies = [s for (cat, _), spans in by_stream.items() if cat == "gpu_memcpy" for s in spans]
    end = max(s + d for s, d in kernels + copies)
    print(f"span {end / 1e3:.2f} ms; kernels busy {union_us(kernels) / 1e3:.2f} ms, copies {union_us(copies) / 1e3:.2f} ms, "
          f"either {union_us(kernels + copies) / 1e3:.2f} ms")
    for (cat, stream), spans in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
        print(f"  stream {stream} {cat}: {len(spans)} events, busy {union_us(spans) / 1e3:.2f} ms")
    host = sorted((e["ts"] - t0, e["dur"], e["name"]) for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("tiers."))
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for _, d, name in host:
        totals[name][0] += 1
        totals[name][1] += d
    print("host ranges (calls, total ms):")
    for name, (n, d) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:36s} {n:5d} {d / 1e3:8.2f}")
    stream = args.stream
    if stream is None:
        stream = max((s for c, s in by_stream if c == "gpu_memcpy"), key=lambda s: union_us(by_stream[("gpu_memcpy", s)]))
    idle, prev = 0.0, 0.0
    print(f"copy stream {stream}: gaps of {args.min_us:.0f} us or more")
    for s, d in sorted(by_stream[("gpu_memcpy", stream)]):
        if s - prev >= args.min_us:
            ran = union_us([(max(ks, prev), min(ks + kd, s) - max(ks, prev)) for ks, kd in kernels if ks < s and ks + kd > prev])
            began = [n.removeprefix("tiers.") for hs, hd, n in host if prev <= hs < s and hd > 30][:6]
            print(f"  {prev:9.0f}-{s:9.0f} us ({s - prev:6.0f}): kernels {ran:6.0f} us; host: {', '.join(began)}")
            idle += s - prev
        prev = max(prev, s + d)
    print(f"copy stream idle in those gaps: {idle / 1e3:.2f} ms of {prev / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
