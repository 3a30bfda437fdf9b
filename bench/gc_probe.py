"""Does Python's garbage collector cost Tiers time? Prefill and decode with it on and off.

    python bench/gc_probe.py [--model qwen3_moe] [--layers 6] [--arm tiers_25_int8] [--reps 5] --out FILE

Builds and packs a random-weight model of real shapes (tiny ones off CUDA; ``tools.measure``), loads the arm (as in
``bench/profile_arms.py``), and alternates, rep by rep, the collector on (Python's default
thresholds) and off: a prefill of ``--prefill`` tokens and a decode of ``--tokens`` tokens
(ms/token as (generate 1 + T) - (generate 1)). Counts the collections of each generation that
ran during the timed calls (``gc.callbacks``) and reports medians.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--arm", default="tiers_25_int8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import tiers
    from tiers.integration import manager_of
    from tiers.tools.measure import build_packed, expert_bytes_of, scratch_dir, shape_of, sync, write_result

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = scratch_dir("tiers-gc-")
    model, packed = build_packed(args.model, args.layers, device, work)
    shape = shape_of(args.model, args.layers, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=g).to(device)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prefill), generator=g).to(device)
    expert_bytes = expert_bytes_of(model)
    del model
    arm = re.fullmatch(r"tiers_(\d+)_(\w+)", args.arm)
    if arm is None:
        raise SystemExit(f"--arm: cannot read {args.arm!r} (expected tiers_<pct>_<precision>)")
    pct, precision = arm.groups()
    cfg = {"tiers": {"gpu": {"fraction": int(pct) / 100}, "cpu": {"budget": expert_bytes, "precision": precision},
                     "nvme": {"precision": precision}}}
    m = tiers.load(packed, cfg, device=device, progress=False)
    kw = dict(do_sample=False, pad_token_id=0)
    collections = [0, 0, 0]

    def counted(phase, info):
        if phase == "start":
            collections[info["generation"]] += 1

    def timed(fn) -> tuple[float, list[int]]:
        sync(device)
        before = list(collections)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0, [a - b for a, b in zip(collections, before)]

    gc.callbacks.append(counted)
    runs = {on: {"prefill_ms": [], "decode_ms_per_token": [], "prefill_gc": [], "decode_gc": []} for on in (True, False)}
    with torch.no_grad():
        m(ids)
        m.generate(prompt, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, **kw)
        for _ in range(args.reps):
            for on in (True, False):
                gc.enable() if on else gc.disable()
                r = runs[on]
                t, n = timed(lambda: m(ids))
                r["prefill_ms"].append(t * 1e3)
                r["prefill_gc"].append(n)
                one, _ = timed(lambda: m.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw))
                full, n = timed(lambda: m.generate(prompt, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, **kw))
                r["decode_ms_per_token"].append((full - one) / args.tokens * 1e3)
                r["decode_gc"].append(n)
    gc.enable()
    gc.callbacks.remove(counted)
    manager_of(m).close()
    result = {"command": "python bench/gc_probe.py " + " ".join(sys.argv[1:]), "model": args.model, "shape": shape, "arm": args.arm,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for on, r in runs.items():
        result["gc_on" if on else "gc_off"] = {
            "prefill_ms": statistics.median(r["prefill_ms"]), "decode_ms_per_token": statistics.median(r["decode_ms_per_token"]),
            "prefill_collections_per_call": [statistics.mean(c[i] for c in r["prefill_gc"]) for i in range(3)],
            "decode_collections_per_generate": [statistics.mean(c[i] for c in r["decode_gc"]) for i in range(3)]}
    print(json.dumps(result, indent=1))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
