"""One token's host-routed decode call on its picks' slots in place, against transformers'
batched_mm forward, which first gathers each pick's weights.

    python bench/picked_decode.py [--model mixtral] [--slots 8] [--pairs 16] [--device cuda] --out FILE

An experts module of the model's real shape seen through ``--slots`` random bf16 slots
(``tiers.integration._SlotExperts``), one token, top-k picks over ``--pairs`` random slot
choices: for each, transformers' ``batched_mm_experts_forward`` with the slots as expert ids
(what the host-routed decode ran before) and the same forward on ``_picked`` views (what it
runs now for one or two picks), checked equal bit for bit, each timed on the device (CUDA-event
medians over 20 calls after a warm-up; on a CPU, wall-clock medians). The bound: reading the picks' weights once from HBM
at 4.8 TB/s. Exits non-zero if any result differs.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

from tiers.tools.measure import SHAPES, TINY, build, event_seconds, timed, write_result  # noqa: E402

HBM_GBPS = 4800.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral", choices=sorted(SHAPES))
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers.integrations.moe import batched_mm_experts_forward

    from tiers.loader.layout import find_experts_modules
    from tiers.integration import _picked, _SlotExperts

    dev = torch.device(args.device)

    def ms(fn) -> float:
        return (event_seconds(fn, 20) if dev.type == "cuda" else timed(fn, dev, 20)) * 1e3
    shape = SHAPES[args.model]
    # the forward reads the module's flags and gate only: a tiny module of the same family serves
    module = find_experts_modules(build(args.model, dict(TINY[args.model], layers=1), torch.device("cpu")))[0][1]
    hidden = shape["hidden_size"]
    inter = shape.get("moe_intermediate_size", shape["intermediate_size"])
    k = shape["num_experts_per_tok"]
    if k > 2:
        raise SystemExit(f"--model {args.model}: top-{k}; the in-place path takes one or two picks")
    g = torch.Generator(device=dev).manual_seed(0)
    slabs = {"gate_up_proj": torch.randn((args.slots, 2 * inter, hidden), generator=g, device=dev, dtype=torch.bfloat16),
             "down_proj": torch.randn((args.slots, hidden, inter), generator=g, device=dev, dtype=torch.bfloat16)}
    proxy = _SlotExperts(module, slabs, args.slots)
    h = torch.randn((1, hidden), generator=g, device=dev, dtype=torch.bfloat16)
    w = torch.rand((1, k), generator=g, device=dev).to(torch.bfloat16)
    rng = random.Random(0)
    rows, exact = [], True
    for _ in range(args.pairs):
        slots = sorted(rng.sample(range(args.slots), k))
        ids = torch.tensor([slots], device=dev)
        picked = _picked(proxy, slots)
        want = batched_mm_experts_forward(proxy, h, ids, w)
        got = batched_mm_experts_forward(picked, h, ids, w)
        same = torch.equal(want, got)
        exact &= same
        gather = ms(lambda: batched_mm_experts_forward(proxy, h, ids, w))
        in_place = ms(lambda: batched_mm_experts_forward(picked, h, ids, w))
        rows.append({"slots": slots, "exact": same, "gather_ms": gather, "in_place_ms": in_place})
    weight_bytes = k * 3 * hidden * inter * 2
    result = {"command": "python bench/picked_decode.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "model": args.model, "top_k": k, "weight_bytes": weight_bytes,
              "bound_ms": weight_bytes / HBM_GBPS / 1e6, "exact": exact,
              "gather_ms": statistics.median(r["gather_ms"] for r in rows),
              "in_place_ms": statistics.median(r["in_place_ms"] for r in rows), "calls": rows}
    write_result(args.out, result)
    print({k: v for k, v in result.items() if k != "calls"})
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
