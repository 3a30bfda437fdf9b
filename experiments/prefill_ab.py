"""A/B of the prefill paths on loaded models, settings alternated within each repetition.

    python experiments/prefill_ab.py [--model qwen3_moe] [--layers 6] [--reps 3] [--configs int8:auto:0,bf16:auto:1]
                               [--fraction 0.25] --out results.json

For each config (cpu-tier precision : staging slots : prefetch depth), Tiers at a GPU budget of
``--fraction`` of the expert bytes with every other expert warm, one forward of 2048 tokens
timed with: streamed (long calls read part by part into reserved slots by the copy engine,
``tiers.streamed``), streamed_direct (the same through direct stacks), streamed_ahead (then the
next layer's first warm experts staged ahead) or parts (the general path through the cache); and the untiered all-GPU model in the same repetition. Reports the
bound max(all-GPU prefill, moved bytes / 55 GB/s), each setting's ratio to it (medians), and
the config's decode ms/token (streamed setting).
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

from tiers.tools.bench_bounds import H2D_BYTES_PER_S  # noqa: E402  (the bench's bounds use the same rate)

# streamed calls, through direct stacks, then staging the next layer ahead (TierManager attributes)
SETTINGS = {"streamed": (True, False, False), "streamed_direct": (True, True, False), "streamed_ahead": (True, False, True),
            "parts": (False, False, False)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--configs", default="int8:auto:0,bf16:auto:0", help="comma-separated precision:staging_slots:prefetch_depth")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import tiers
    from tiers.integration import manager_of
    from tiers.tools.measure import build_packed, decode_ms_per_token, prefill_seconds, scratch_dir, warm_config

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    plain, packed = build_packed(args.model, args.layers, device, scratch_dir("tiers-prefill-ab-"))
    ids = torch.randint(0, plain.config.vocab_size, (1, 2048 if cuda else 64), generator=torch.Generator().manual_seed(1)).to(device)
    prompt = ids[:, :16]
    prefill_seconds(plain, ids, device, 1)
    decode_ms_per_token(plain, prompt, 2, device, 1)
    out = {"command": "python experiments/prefill_ab.py " + " ".join(sys.argv[1:]),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "configs": {}}
    for spec in args.configs.split(","):
        precision, staging, depth = spec.split(":")
        cfg = warm_config(precision, staging, depth, args.fraction)
        m = tiers.load(packed, cfg, device=device, progress=False)
        mgr = manager_of(m)
        runs = {k: {"prefill_s": [], "moved_bytes": [], "streamed_parts": []} for k in SETTINGS} | {"all_gpu": {"prefill_s": []}}
        for name, setting in SETTINGS.items():  # warm-up
            mgr.streamed_calls, mgr.stream_direct, mgr.stream_ahead = setting
            prefill_seconds(m, ids, device, 1)
        for _ in range(args.reps):
            for name, setting in SETTINGS.items():
                mgr.streamed_calls, mgr.stream_direct, mgr.stream_ahead = setting
                mgr.reset_stats()
                runs[name]["prefill_s"].append(prefill_seconds(m, ids, device, 1))
                s = mgr.stats()
                runs[name]["moved_bytes"].append(sum(s.bytes_moved.values()) / 2)  # prefill_seconds warms up once
                runs[name]["streamed_parts"].append(s.streamed["parts"] / 2)
            runs["all_gpu"]["prefill_s"].append(prefill_seconds(plain, ids, device, 1))
        runs["all_gpu"]["decode_ms"] = [decode_ms_per_token(plain, prompt, 16, device, 1) for _ in range(args.reps)]
        med = {k: {f: statistics.median(v) for f, v in r.items()} for k, r in runs.items()}
        gpu = med["all_gpu"]["prefill_s"]
        for name in SETTINGS:
            bound = max(gpu, med[name]["moved_bytes"] / H2D_BYTES_PER_S)
            med[name] |= {"bound_s": bound, "over_bound": med[name]["prefill_s"] / bound}
        staging_slots = mgr.stats().gpu_slots["staging"]
        mgr.streamed_calls, mgr.stream_direct, mgr.stream_ahead = SETTINGS["streamed"]
        decode = statistics.median(decode_ms_per_token(m, prompt, 16, device, 1) for _ in range(args.reps))
        out["configs"][spec] = {"config": cfg, "staging_slots": staging_slots, "decode_ms_per_token": decode, "median": med, "runs": runs}
        print(spec, f"staging {staging_slots}", f"decode {decode:.2f} ms/token", json.dumps({k: {f: round(v, 4) for f, v in r.items()} for k, r in med.items()}), flush=True)
        mgr.close()
        del m, mgr
        if cuda:
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
