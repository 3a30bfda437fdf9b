"""A streamed part's bf16 copies: one ``copy_`` per expert and tensor, 2-D copies, or one batch.

    python experiments/h2d_probe.py [--experts 8,16] [--models qwen3_moe,mixtral] [--reps 20] --out FILE

A streamed part of bf16 experts moves each expert's tensors from its blob in the pinned host
pool into its slot of each tensor's slab. This queues such a part on a side stream, with
Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes, its blobs back to back in the pool (spread 1,
a whole-layer call's) or every other place (spread 2, like a call that reads only the experts
its tokens were routed to), four ways: ``plain`` (one copy of the same number of bytes, the
bound), ``per_tensor`` (``Tensor.copy_`` per expert and tensor), ``pitched``
(``cuMemcpy2DAsync``, called here: one 2-D driver call per tensor for blobs back to back, their
rows a blob apart in the pool and a slot apart in the slab, else one per expert and tensor) and
``batch`` (``tiers.h2d.copy_batch``, the engine's: one driver call for the part).
Reports, medians over ``--reps``: the host's time to queue the part (per expert), the copy
stream's time for it (CUDA events) and its rate, and whether each way's slots came out equal
to the blobs (``torch.equal``).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from tiers.host_pool import HostPool  # noqa: E402
from tiers.h2d import copy_batch  # noqa: E402


class Copy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D``."""

    _fields_ = [(n, t) for side in ("src", "dst") for n, t in (
        (f"{side}XInBytes", ctypes.c_size_t), (f"{side}Y", ctypes.c_size_t), (f"{side}MemoryType", ctypes.c_int),
        (f"{side}Host", ctypes.c_void_p), (f"{side}Device", ctypes.c_uint64), (f"{side}Array", ctypes.c_void_p),
        (f"{side}Pitch", ctypes.c_size_t))] + [("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_copy2d = ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2
_copy2d.argtypes, _copy2d.restype = [ctypes.POINTER(Copy2D), ctypes.c_void_p], ctypes.c_int


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """One 2-D copy: host byte rows ``src`` [k, width] into device byte rows ``dst`` [k, width]."""
    p = Copy2D(srcMemoryType=1, srcHost=src.data_ptr(), srcPitch=src.stride(0), dstMemoryType=2, dstDevice=dst.data_ptr(),
               dstPitch=dst.stride(0), WidthInBytes=src.shape[1], Height=src.shape[0])
    rc = _copy2d(ctypes.byref(p), stream.cuda_stream)
    assert rc == 0, f"cuMemcpy2DAsync failed: {rc}"


SHAPES = {  # expert tensors, bf16: name -> shape (the experts module's own layout)
    "qwen3_moe": {"gate_up_proj": (1536, 2048), "down_proj": (2048, 768)},
    "mixtral": {"gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)},
}


def probe(name: str, shapes: dict, k: int, spread: int, reps: int, device: torch.device) -> dict:
    sizes = {n: 2 * s[0] * s[1] for n, s in shapes.items()}
    blob = sum(sizes.values())  # both shapes keep every field 4 KiB aligned: the blob is its stride
    pool = HostPool(k * spread * blob, pin=True)
    host = pool.view(pool.alloc(k * spread * blob), k * spread * blob)  # [k * spread * blob] uint8, pinned
    rows = host.view(k * spread, blob)[::spread]  # [k, blob]: the part's blobs, every spread-th place
    base = torch.randint(0, 256, (blob + k,), dtype=torch.uint8)
    for i in range(k):  # each row its own bytes: a row copied into the wrong slot shows
        rows[i].copy_(base[i : i + blob])
    slabs = {n: torch.empty((k, *s), dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    offs, o = {}, 0
    for n in shapes:
        offs[n] = o
        o += sizes[n]
    flat = torch.empty(k * blob, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)

    def per_tensor():
        with torch.cuda.stream(stream):
            for i in range(k):
                for n, s in shapes.items():
                    slabs[n][i].copy_(rows[i, offs[n]:offs[n] + sizes[n]].view(torch.bfloat16).view(s), non_blocking=True)

    def pitched():  # blobs back to back: one call per tensor; else one per expert and tensor (runs of one)
        for n in shapes:
            if spread == 1:
                copy_rows(slabs[n].view(k, -1).view(torch.uint8), rows[:, offs[n]:offs[n] + sizes[n]], stream)
            else:
                for i in range(k):
                    copy_rows(slabs[n][i : i + 1].view(1, -1).view(torch.uint8), rows[i : i + 1, offs[n]:offs[n] + sizes[n]], stream)

    pairs = [(slabs[n][i].view(-1).view(torch.uint8), rows[i, offs[n]:offs[n] + sizes[n]]) for i in range(k) for n in shapes]

    def batch():
        copy_batch([d for d, _ in pairs], [s for _, s in pairs], stream)

    def plain():
        with torch.cuda.stream(stream):
            flat.copy_(host[: k * blob], non_blocking=True)

    def check() -> bool:
        torch.cuda.synchronize(device)
        return all(torch.equal(slabs[n].view(k, -1).view(torch.uint8).cpu(), rows[:, offs[n]:offs[n] + sizes[n]]) for n in shapes)

    out = {"model": name, "experts": k, "spread": spread, "expert_bytes": blob}
    for label, fn in (("plain", plain), ("per_tensor", per_tensor), ("pitched", pitched), ("batch", batch)):
        for slab in slabs.values():
            slab.zero_()
        host_us, dev_ms = [], []
        for _ in range(reps):
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            t0 = time.perf_counter()
            fn()
            host_us.append((time.perf_counter() - t0) * 1e6)
            b.record(stream)
            b.synchronize()
            dev_ms.append(a.elapsed_time(b))
        ms = statistics.median(dev_ms)
        out[label] = {"host_us_per_expert": round(statistics.median(host_us) / k, 2), "device_ms": round(ms, 3),
                      "gb_per_s": round(k * blob / ms / 1e6, 1)}
        if label != "plain":
            out[label]["exact"] = check()
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="8,16")
    ap.add_argument("--models", default="qwen3_moe,mixtral")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    device = torch.device("cuda")
    results = []
    for model in a.models.split(","):
        for k in (int(x) for x in a.experts.split(",")):
            if model == "mixtral":
                k = min(k, 4)  # 4 Mixtral experts are 1.4 GB of pinned memory already
                if any(r["model"] == model and r["experts"] == k for r in results):
                    continue
            for spread in (1, 2):
                results.append(probe(model, SHAPES[model], k, spread, a.reps, device))
                print(json.dumps(results[-1]), flush=True)
    cmd = "python experiments/h2d_probe.py " + " ".join(sys.argv[1:])
    with open(a.out, "w") as f:
        json.dump({"command": cmd, "device": torch.cuda.get_device_name(device), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
