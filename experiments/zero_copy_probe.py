"""Probe: dequantize INT8 experts straight from pinned host memory into GPU slots with one
Triton launch per tensor (the GPU's SMs read the host pages over PCIe), against the copy
engine (one copy per expert into a transit row, then a multiply into the slot).

Prints JSON: GPU time and GB/s of each path for n experts of a shape, exactness of the fused
result against the copy path, and the host time of one launch.

    python experiments/zero_copy_probe.py --out results.json
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import mmap  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tiers.tools.measure import event_seconds  # noqa: E402

SHAPES = {  # name -> ((gate_up rows, cols), (down rows, cols))
    "qwen3_moe": ((1536, 2048), (2048, 768)),
    "mixtral": ((28672, 4096), (4096, 14336)),
}


@triton.jit
def _dequant(pool, blob_off, slots, out, q_off, s_off, slot_elems, cols, n_elem, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    b = tl.program_id(1)
    base = tl.load(blob_off + e)
    slot = tl.load(slots + e).to(tl.int64)
    i = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_elem
    q = tl.load((pool + base + q_off).to(tl.pointer_type(tl.int8)) + i, mask=m, other=0)
    s = tl.load((pool + base + s_off).to(tl.pointer_type(tl.float32)) + i // cols, mask=m, other=0.0)
    tl.store(out + slot * slot_elems + i, (q.to(tl.float32) * s).to(tl.bfloat16), mask=m)


def _host_costs(host, stride: int, transit, slabs, fields, blob_off, slots_d) -> dict:
    """Host microseconds per fused launch pair, per copy and per torch.mul, 200 of each, no sync in between."""
    res = {}
    blob_off1 = blob_off[:1].clone()
    slots1 = slots_d[:1].clone()
    def one():
        for (q_off, s_off, r, c), slab in zip(fields, slabs):
            _dequant[(1, triton.cdiv(r * c, 8192))](host, blob_off1, slots1, slab, q_off, s_off, r * c, c, r * c, BLOCK=8192, num_warps=4)
    one()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        one()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    res["host_us_per_launch_pair"] = (t1 - t0) / 200 * 1e6
    src = host[:stride]
    t0 = time.perf_counter()
    for _ in range(200):
        transit[0].copy_(src, non_blocking=True)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    res["host_us_per_copy"] = (t1 - t0) / 200 * 1e6
    q = transit[0, :1536 * 2048].view(torch.int8).view(1536, 2048)
    sc = transit[0, :1536 * 4].view(torch.float32).view(1536, 1)
    t0 = time.perf_counter()
    for _ in range(200):
        torch.mul(q, sc, out=slabs[0][0])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    res["host_us_per_mul"] = (t1 - t0) / 200 * 1e6
    print(json.dumps({k: res[k] for k in ("host_us_per_launch_pair", "host_us_per_copy", "host_us_per_mul")}), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "runs": []}
    for name, shapes in SHAPES.items():
        fields = []  # (q_off, s_off, rows, cols) within a blob
        off = 0
        for r, c in shapes:
            q_off = off
            off = (off + r * c + 255) // 256 * 256
            s_off = off
            off = (off + r * 4 + 255) // 256 * 256
            fields.append((q_off, s_off, r, c))
        stride = (off + 4095) // 4096 * 4096
        n_pool = 64 if name == "qwen3_moe" else 6
        n_slots = 48 if name == "qwen3_moe" else 4
        mm = mmap.mmap(-1, stride * n_pool)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        assert int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)) == 0
        g = torch.Generator().manual_seed(0)
        for e in range(n_pool):
            for q_off, s_off, r, c in fields:
                host[e * stride + q_off : e * stride + q_off + r * c].view(torch.int8).copy_(torch.randint(-127, 128, (r * c,), generator=g, dtype=torch.int8))
                host[e * stride + s_off : e * stride + s_off + r * 4].view(torch.float32).copy_(torch.rand(r, generator=g) * 0.01)
        slabs = [torch.empty((n_slots, r, c), dtype=torch.bfloat16, device=dev) for _, _, r, c in fields]
        transit = torch.empty((n_slots, stride), dtype=torch.uint8, device=dev)
        for n in ([1, 4, 8, 32, 48] if name == "qwen3_moe" else [1, 4]):
            perm = torch.randperm(n_pool, generator=g)[:n]
            slot_ids = torch.randperm(n_slots, generator=g)[:n]
            blob_off = (perm * stride).to(torch.int64).to(dev)
            slots_d = slot_ids.to(torch.int32).to(dev)
            nbytes = n * sum(r * c + r * 4 for _, _, r, c in fields)

            def fused(block, warps):
                for (q_off, s_off, r, c), slab in zip(fields, slabs):
                    grid = (n, triton.cdiv(r * c, block))
                    _dequant[grid](host, blob_off, slots_d, slab, q_off, s_off, r * c, c, r * c, BLOCK=block, num_warps=warps)

            def engine():
                for i in range(n):
                    e, s = int(perm[i]), int(slot_ids[i])
                    transit[s].copy_(host[e * stride : (e + 1) * stride], non_blocking=True)
                for i in range(n):
                    s = int(slot_ids[i])
                    for (q_off, s_off, r, c), slab in zip(fields, slabs):
                        q = transit[s, q_off : q_off + r * c].view(torch.int8).view(r, c)
                        sc = transit[s, s_off : s_off + r * 4].view(torch.float32).view(r, 1)
                        torch.mul(q, sc, out=slab[s])

            t_engine = event_seconds(engine, 10)
            ref = [slab[slot_ids.to(dev)].clone() for slab in slabs]
            row = {"shape": name, "experts": n, "bytes": nbytes, "bound_s": nbytes / 55e9,
                   "engine_s": t_engine, "engine_gbps": nbytes / t_engine / 1e9, "fused": []}
            for block in (2048, 8192, 32768):
                for warps in (4, 8):
                    for slab in slabs:
                        slab.zero_()
                    t = event_seconds(lambda: fused(block, warps), 10)
                    exact = all(torch.equal(slab[slot_ids.to(dev)], r_) for slab, r_ in zip(slabs, ref))
                    row["fused"].append({"block": block, "warps": warps, "s": t, "gbps": nbytes / t / 1e9, "exact": exact})
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
        if name == "qwen3_moe":  # host time per launch pair (both tensors), small n, no sync in between
            res.update(_host_costs(host, stride, transit, slabs, fields, blob_off, slots_d))
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        del host
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
