"""Host-to-device rate from the host pool's slab: does how its pages were mapped matter?

    python bench/pool_h2d.py [--gib 4] [--chunk-mib 64,4] [--churn-gib 16] [--reps 3] --out FILE

Copies ``--gib`` of pinned host memory to the GPU in chunks of each ``--chunk-mib`` on one side
stream, from: a ``HostPool`` slab as the engine makes it (an anonymous mmap registered with
``cudaHostRegister``), the same with ``MADV_HUGEPAGE`` asked for before its pages are touched, and
``torch.empty(pin_memory=True)``; each once in a fresh process state and once after
``--churn-gib`` of host memory was allocated, touched and freed in small pieces (what earlier
arms of a bench run leave behind). Reports GB/s (median over ``--reps``) and, from
``/proc/self/smaps``, how much of each slab the kernel backs with huge pages, with the machine's
transparent-huge-page settings.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import mmap  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402


def huge_kib(addr: int) -> int | None:
    """AnonHugePages (KiB) of the mapping holding ``addr``, from /proc/self/smaps (None if absent)."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def rate(src: torch.Tensor, dst: torch.Tensor, chunk: int, reps: int) -> float:
    """GB/s of copying ``src`` into ``dst`` in ``chunk``-byte copies on a side stream, median of ``reps``."""
    stream = torch.cuda.Stream()
    out = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            for off in range(0, src.numel(), chunk):
                dst[off : off + chunk].copy_(src[off : off + chunk], non_blocking=True)
            b.record()
        b.synchronize()
        out.append(src.numel() / (a.elapsed_time(b) / 1e3) / 1e9)
    return statistics.median(out[1:])


def slabs(nbytes: int) -> dict:
    from tiers.host_pool import HostPool, pin_host

    pool = HostPool(nbytes, pin=True)
    huge = mmap.mmap(-1, nbytes)
    huge.madvise(mmap.MADV_HUGEPAGE)
    huge_t = torch.frombuffer(huge, dtype=torch.uint8)
    huge_t.fill_(1)  # fault the pages in after the advice, then pin them
    pin_host(huge_t)
    return {"pool": (pool.slab, pool), "pool_hugepage": (huge_t, huge), "torch_pinned": (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None)}


def measure(nbytes: int, chunks: list[int], reps: int) -> dict:
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    got = {}
    made = slabs(nbytes)
    for name, (t, _) in made.items():
        t.fill_(2)
        got[name] = {"huge_kib": huge_kib(t.data_ptr()), "gbps": {str(c >> 20): rate(t, dst, c, reps) for c in chunks}}
    for name, (t, keep) in made.items():
        if name == "pool":
            keep.close()
        elif name == "pool_hugepage":
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    return got


def churn(nbytes: int) -> None:
    """Allocate ``nbytes`` of host memory in 1-9 MiB pieces, touch it, free every other piece,
    then the rest: the fragmentation earlier work leaves."""
    pieces = [torch.ones(((i % 9) + 1) << 20, dtype=torch.uint8) for i in range(nbytes // (5 << 20))]
    del pieces[::2]
    del pieces


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--chunk-mib", default="64,4")
    ap.add_argument("--churn-gib", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pool_h2d: needs CUDA")
    nbytes = int(args.gib * 2**30)
    chunks = [int(float(c) * 2**20) for c in args.chunk_mib.split(",")]
    thp = {}
    for f in ("enabled", "defrag"):
        try:
            thp[f] = open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip()
        except OSError:
            thp[f] = None
    result = {"command": "python bench/pool_h2d.py " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(), "thp": thp}
    result["fresh"] = measure(nbytes, chunks, args.reps)
    churn(int(args.churn_gib * 2**30))
    result["after_churn"] = measure(nbytes, chunks, args.reps)
    print(json.dumps(result, indent=1))
    from tiers.tools.measure import write_result

    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
