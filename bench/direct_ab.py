"""A/B of the direct-read paths on one loaded model, settings alternated within each repetition.

    python bench/direct_ab.py [--model qwen3_moe] [--layers 6] [--reps 3] --out results.json

Tiers at a 25% GPU budget with an INT8 cpu tier holding the other experts, timed with:
copy (both direct paths off), stacks (direct stacks in the staging path only), decode (direct
decode only), both; and the untiered all-GPU model in the same repetition. Decode ms/token is
(generate 1 + T) - (generate 1); prefill is one forward of 2048 tokens.
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

SETTINGS = {"copy": (False, False), "stacks": (True, False), "decode": (False, True), "both": (True, True)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import tiers
    from tiers.integration import manager_of
    from tiers.tools.measure import build_packed, decode_ms_per_token, prefill_seconds, scratch_dir

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    plain, packed = build_packed(args.model, args.layers, device, scratch_dir("tiers-ab-"))
    m = tiers.load(packed, {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"budget": "1TB", "precision": "int8"}}},
                   device=device, progress=False)
    mgr = manager_of(m)
    prompt = torch.randint(0, plain.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    ids = torch.randint(0, plain.config.vocab_size, (1, 2048 if cuda else 64), generator=torch.Generator().manual_seed(1)).to(device)
    runs = {k: {"decode_ms": [], "prefill_s": [], "moved_mib_per_token": []} for k in [*SETTINGS, "all_gpu"]}
    for model in (plain, m):  # warm-up: kernels and caches
        decode_ms_per_token(model, prompt, 2, device, 1)
        prefill_seconds(model, ids, device, 1)
    for _ in range(args.reps):
        for name, (stacks, dec) in SETTINGS.items():
            mgr.direct_reads, mgr.direct_decode = stacks, dec
            mgr.reset_stats()
            runs[name]["decode_ms"].append(decode_ms_per_token(m, prompt, args.tokens, device, 1))
            runs[name]["moved_mib_per_token"].append(sum(mgr.stats().bytes_moved.values()) / 2**20 / (args.tokens + 2))
            runs[name]["prefill_s"].append(prefill_seconds(m, ids, device, 1))
        runs["all_gpu"]["decode_ms"].append(decode_ms_per_token(plain, prompt, args.tokens, device, 1))
        runs["all_gpu"]["prefill_s"].append(prefill_seconds(plain, ids, device, 1))
    out = {"command": f"python bench/direct_ab.py --model {args.model} --layers {args.layers} --reps {args.reps} --tokens {args.tokens}",
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "median": {k: {f: statistics.median(v) for f, v in r.items() if v} for k, r in runs.items()}, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["median"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
