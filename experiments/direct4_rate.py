"""How fast does the 4-bit direct-decode kernel read experts from pinned memory (and from GPU memory), by tile shape, against INT8's kernel?

    PYTHONPATH=. python3 experiments/direct4_rate.py [--reps 50] [--tiles first|large|spread] [--models ...] [--out FILE]

On a CUDA machine. Experts of gpt-oss-20b's shapes (``gate_up_proj`` [2880, 5760], ``down_proj``
[2880, 2880], stored transposed, biases apart) and of Qwen3-30B-A3B's ([1536, 2048], [2048, 768]),
32 of them in pinned memory, in each 4-bit precision (MXFP4 only for gpt-oss) and INT8. Times
``quant.direct.fetch`` of 4 picks (a decode call's misses, gpt-oss's top-4; for Qwen3 8, its
top-8) into bf16 slots, by CUDA events, median of ``--reps`` after warm-ups; the rate counts the
blob bytes read. For the 4-bit kernel, each (rows, codes, warps) of ``TILES``: the first run
(``direct4_rate.json``) had programs of 4096 codes on 4 warps; ``--tiles large`` times programs
of 8192 and 16384 codes on 4 and 8 warps (INT8's kernel reads 8192 bytes a program on 8).
``--tiles spread`` times the kernel that reads each group's statistics once, where a tile holds
whole groups, from pinned memory and from GPU memory (``source`` "dev": quantized hot experts),
with Mixtral-8x7B's shapes too (top-2).
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

TILES = {"first": [(32, 128, 4), (8, 512, 4), (4, 1024, 4), (2, 2048, 4), (16, 256, 4), (1, 4096, 4)],
         "large": [(4, 1024, 4), (8, 1024, 4), (8, 1024, 8), (4, 2048, 8), (16, 1024, 8), (8, 2048, 8), (4, 4096, 8)],
         "base": [(4, 1024, 4), (8, 1024, 4), (8, 2048, 8)],
         "wide": [(4, 1024, 4), (8, 1024, 8), (8, 2048, 8), (16, 1024, 8), (16, 2048, 8), (8, 4096, 8), (32, 1024, 8), (16, 2048, 16)],
         "spread": [(4, 1024, 4), (8, 1024, 4), (8, 1024, 8), (16, 1024, 8), (2, 2048, 4), (32, 256, 4), (64, 256, 8)]}
MODELS = {
    "gpt_oss": dict(shapes=((2880, 5760), (2880, 2880)), transposed=True, picks=4, precisions=("mxfp4", "int4", "nf4", "int8")),
    "qwen3_moe": dict(shapes=((1536, 2048), (2048, 768)), transposed=False, picks=8, precisions=("int4", "nf4", "int8")),
    "mixtral": dict(shapes=((28672, 4096), (4096, 14336)), transposed=False, picks=2, precisions=("int4", "int8"), experts=6),
}


def experts(model: str, precision: str, n: int):
    """``n`` blobs of random weights (exactly MXFP4 for mxfp4) in one pinned buffer; the blob layout."""
    from tiers.loader.blob import blob_layout
    from tiers.loader.layout import ExpertLayout, ExpertTensor
    from tiers.quant import mxfp4

    spec = MODELS[model]
    tensors = tuple(ExpertTensor(name, shape) for name, shape in zip(("gate_up_proj", "down_proj"), spec["shapes"]))
    layout = ExpertLayout(n, tensors, is_transposed=spec["transposed"], is_concatenated=not spec["transposed"])
    blob = blob_layout(layout, precision)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(n):
        ws = {}
        for t in tensors:
            if precision == "mxfp4":
                k, m = t.shape
                b = torch.randint(0, 256, (m, k // 32, 16), dtype=torch.uint8, device="cuda", generator=g)
                s = torch.randint(116, 121, (m, k // 32), dtype=torch.uint8, device="cuda", generator=g)
                ws[t.name] = mxfp4.decode(b, s)
            else:
                ws[t.name] = (torch.randn(t.shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        out.append(blob.encode(ws)[0])
    return blob, torch.cat(out).pin_memory()


def rate(blob, buf, model: str, reps: int, source: str = "host") -> dict:
    from tiers.quant.direct import fetch
    from tiers.quant.direct import expert_of

    spec = MODELS[model]
    slabs = {name: torch.empty((16, *shape), dtype=torch.bfloat16, device="cuda") for name, shape in blob.shapes}
    tensors = expert_of(slabs, blob, blob.precision)
    n = buf.numel() // blob.stride
    starts = torch.arange(n, device="cuda") * blob.stride
    dev = buf.to("cuda") if source == "dev" else None
    if dev is not None:  # quant.direct's second source: negative starts
        starts = -1 - starts
    resident = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    k = spec["picks"]
    dst = torch.arange(k, dtype=torch.int32, device="cuda")
    ids, counts = torch.empty(k, dtype=torch.int64, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda")
    times = []
    for r in range(reps + 3):
        picks = torch.randperm(n, device="cuda")[:k]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fetch(buf, starts, resident, picks, dst, ids, counts, tensors, dev=dev)
        b.record()
        b.synchronize()
        if r >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    t = statistics.median(times)
    return {"source": source, "ms": t * 1e3, "gb_s": k * blob.nbytes / t / 1e9, "blob_bytes": blob.nbytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="experiments/results/direct4_rate.json")
    ap.add_argument("--tiles", choices=sorted(TILES), default="first")
    ap.add_argument("--models", default="gpt_oss,qwen3_moe", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--sources", default="host", help="comma-separated: host (pinned memory), dev (GPU memory)")
    args = ap.parse_args()
    from tiers.quant import direct, direct4_kernel

    result = {"command": f"python3 experiments/direct4_rate.py --reps {args.reps} --tiles {args.tiles} --models {args.models} "
                         f"--sources {args.sources}", "device": torch.cuda.get_device_name(), "rows": []}
    for model in args.models.split(","):
        spec = MODELS[model]
        for precision in spec["precisions"]:
            blob, buf = experts(model, precision, spec.get("experts", 32))
            tiles = TILES[args.tiles] if precision != "int8" else [None]
            for tile in tiles:
                if tile:
                    direct.TILE_R, direct.TILE_C = tile[:2]
                    direct4_kernel.TILE_R, direct4_kernel.TILE_C, direct4_kernel.WARPS = tile
                for source in args.sources.split(","):
                    row = {"model": model, "precision": precision, "tile": tile, **rate(blob, buf, model, args.reps, source)}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
            del buf
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
