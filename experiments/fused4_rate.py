"""Does a fused int4 product (``quant.fused4``) beat decoding a quantized hot expert into a bf16 slot, and at which program shape?

    PYTHONPATH=. python3 experiments/fused4_rate.py [--reps 30] [--models qwen3_moe,mixtral] [--out FILE]

On a CUDA machine. Experts of Qwen3-30B-A3B's shapes (``gate_up_proj`` [1536, 2048], ``down_proj``
[2048, 768]; 8 picks, a decode token's top-8) and Mixtral-8x7B's ([28672, 4096], [4096, 14336];
2 picks), int4 blobs in GPU memory (the blob pool) and the same weights in bf16. One token's
experts MLP (both projections and SiLU gating), timed by CUDA events, median of ``--reps``:

- ``bf16``: every expert hot in bf16, one ``F.linear`` per pick and projection (no gather);
- ``slot``: ``quant.direct.fetch`` decodes the picks into bf16 slots, then the same products;
- ``fused``: ``quant.fused4.linear`` twice, for each (output rows, inputs, warps) of ``SHAPES``.

The bound of each: the bytes it must read and write over the GPU's memory rate, measured in the
same run as one large device-to-device copy (read plus write bytes over its time).
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = [(4, 512, 4), (8, 512, 4), (16, 512, 4), (32, 512, 4), (16, 256, 4), (8, 1024, 4), (16, 1024, 4), (16, 1024, 8),
          (32, 1024, 8)]
MODELS = {"qwen3_moe": dict(shapes=((1536, 2048), (2048, 768)), picks=8, experts=32),
          "mixtral": dict(shapes=((28672, 4096), (4096, 14336)), picks=2, experts=8)}


def timed(fn, reps: int, picks_of) -> float:
    """Median ms of ``fn(picks)`` over ``reps`` calls after three warm-ups, fresh picks each."""
    times = []
    for r in range(reps + 3):
        picks = picks_of()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(picks)
        b.record()
        b.synchronize()
        if r >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def memory_rate() -> float:
    """GB/s of read plus written bytes of one 2 GiB device-to-device copy."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = timed(lambda _: b.copy_(a), 10, lambda: None)
    return 2 * a.numel() / ms / 1e6


def model_rows(model: str, reps: int, rate: float) -> list[dict]:
    from tiers.loader.blob import blob_layout
    from tiers.loader.layout import ExpertLayout, ExpertTensor
    from tiers.quant import direct, fused4, fused4_kernel
    from tiers.quant.direct import expert_of, fetch

    spec = MODELS[model]
    n, k = spec["experts"], spec["picks"]
    tensors = tuple(ExpertTensor(name, shape) for name, shape in zip(("gate_up_proj", "down_proj"), spec["shapes"]))
    blob = blob_layout(ExpertLayout(n, tensors), "int4")
    stride = -(-blob.stride // 4096) * 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.zeros(n * stride, dtype=torch.uint8, device="cuda")
    bf16 = {t.name: torch.empty((n, *t.shape), dtype=torch.bfloat16, device="cuda") for t in tensors}
    for e in range(n):
        ws = {t.name: (torch.randn(t.shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for t in tensors}
        enc = blob.encode(ws)[0].to("cuda")
        pool[e * stride : e * stride + enc.numel()] = enc
        for name, w in ws.items():
            bf16[name][e] = w
    slabs = {t.name: torch.empty((k, *t.shape), dtype=torch.bfloat16, device="cuda") for t in tensors}
    dt = expert_of(slabs, blob, "int4")
    up, down = dt
    starts = -1 - torch.arange(n, device="cuda") * stride
    hidden = spec["shapes"][0][1]
    x = (torch.randn(1, hidden, device="cuda", generator=g)).to(torch.bfloat16)

    def picks_of():
        return torch.randperm(n, device="cuda")[:k]

    def mlp(weights):  # weights(j, name) -> [out, in]
        def run(picks):
            for j in range(k):
                h = F.linear(x, weights(j, picks, "gate_up_proj"))
                gate, u = h.chunk(2, dim=-1)
                F.linear(F.silu(gate) * u, weights(j, picks, "down_proj"))
        return run

    plist = {}

    def by_pick(j, picks, name):  # the bf16 arm reads the expert's weight in place (picks on the host: no sync in the timing)
        return bf16[name][plist["host"][j]]

    rows = []
    int4_bytes, bf16_bytes = k * blob.nbytes, k * sum(2 * t.shape[0] * t.shape[1] for t in tensors)

    def add(arm, ms, moved, shape=None):
        row = {"model": model, "arm": arm, "shape": shape, "ms": ms, "bound_ms": moved / rate / 1e6, "bytes": moved}
        rows.append(row)
        print(json.dumps(row), flush=True)

    host_picks = lambda: plist.__setitem__("host", torch.randperm(n)[:k].tolist())  # noqa: E731
    add("bf16", timed(mlp(by_pick), reps, host_picks), bf16_bytes)
    ids, counts = torch.empty(k, dtype=torch.int64, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda")
    resident = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    dst = torch.arange(k, dtype=torch.int32, device="cuda")

    def slot(picks):
        fetch(pool, starts, resident, picks, dst, ids, counts, dt, dev=pool)
        mlp(lambda j, p, name: slabs[name][j])(picks)
    add("slot", timed(slot, reps, picks_of), int4_bytes + 2 * bf16_bytes)  # read int4, write and read bf16 slots
    for bn, bk, warps in SHAPES:
        def fused(picks):
            out_up = torch.empty((k, up.rows), dtype=torch.bfloat16, device="cuda")
            fused4_kernel.launch(x, k, picks, starts, pool, up, out_up, bn, bk, warps)
            gate, u = out_up.chunk(2, dim=-1)
            a = (F.silu(gate) * u).contiguous()
            fused4_kernel.launch(a, 1, picks, starts, pool, down, torch.empty((k, down.rows), dtype=torch.bfloat16, device="cuda"),
                                 bn, bk, warps)
        add("fused", timed(fused, reps, picks_of), int4_bytes, [bn, bk, warps])
    # the library's own call, its default shape: agrees with the reference's arithmetic (checked by the tests)
    assert fused4.qualifies(up) and fused4.qualifies(down) and direct.kernel_available()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--models", default="qwen3_moe,mixtral")
    ap.add_argument("--out", default="experiments/results/fused4_rate.json")
    args = ap.parse_args()
    rate = memory_rate()
    print(f"device-to-device copy: {rate:.0f} GB/s (read + write)", flush=True)
    result = {"command": f"python3 experiments/fused4_rate.py --reps {args.reps} --models {args.models}",
              "device": torch.cuda.get_device_name(), "memory_gb_s": rate, "rows": []}
    for model in args.models.split(","):
        result["rows"] += model_rows(model, args.reps, rate)
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
