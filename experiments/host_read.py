"""How fast does this machine move pinned host memory to the GPU: by the copy engine, and by the SMs' own reads?

    PYTHONPATH=. python3 experiments/host_read.py --out FILE

On a CUDA machine. The 4-bit warm decode reads its misses with the SMs (direct decode) and is
judged against bytes at 55 GB/s; H200 machines differ in how close they come (``LIMITS.md``). Times,
by CUDA events (median of 20 after warm-ups), a copy-engine copy of 16, 64 and 180 MB (Qwen3-30B-A3B's
int4 misses of a 12-layer token) from pinned memory, 12 copies of 15 MB in a row, and a plain
Triton kernel that copies the same 180 MB with its loads (programs of 8192 bytes on 8 warps, and
of 32768). Records the host's NUMA nodes and the GPU's node as ``nvidia-smi topo`` names them.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _read(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


def _gb_s(fn, nbytes: int, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return round(nbytes / statistics.median(times) / 1e9, 1)


def _shell(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout[-3000:]
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rates = {}
    for mb in (16, 64, 180):
        src = torch.empty(mb * 10**6, dtype=torch.uint8).pin_memory()
        dst = torch.empty_like(src, device="cuda")
        rates[f"engine_{mb}MB"] = _gb_s(lambda: dst.copy_(src, non_blocking=True), src.numel())
    src = torch.empty(180 * 10**6, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    parts = [(src[i * 15 * 10**6:(i + 1) * 15 * 10**6], dst[i * 15 * 10**6:(i + 1) * 15 * 10**6]) for i in range(12)]
    rates["engine_12x15MB"] = _gb_s(lambda: [d.copy_(s, non_blocking=True) for s, d in parts], src.numel())
    s64, d64, n = src.view(torch.int64), dst.view(torch.int64), src.numel() // 8
    for block in (1024, 4096):  # int64 elements a program: 8 and 32 KB
        rates[f"sm_reads_{block * 8 // 1024}KB"] = _gb_s(
            lambda: _read[(triton.cdiv(n, block),)](s64, d64, n, BLOCK=block, num_warps=8), src.numel())
    assert torch.equal(dst.cpu(), src)
    result = {"command": "python3 experiments/host_read.py " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(),
              "gb_s": rates, "topo": _shell("nvidia-smi topo -m"), "numa": _shell("lscpu | grep -i numa")}
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
