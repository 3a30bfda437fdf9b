"""Does decoding two all-GPU models step by step in turn (``tools.measure.interleaved_decode``) slow
some steps by itself? Two or three random-weight models of a real shape on the GPU, transformers'
default experts implementation (batched_mm in decode), stepped in turn under a few conditions:

- ``alternate``: the interleaved decode as the bench runs it (the order within a step alternating);
- ``blocks``: each model alone for 8 steps at a time, the two in turn (every step follows the model's own last one);
- ``gcoff``: alternating, Python's garbage collector off;

and per condition the step times and the CUDA caching allocator's counters around it
(``num_alloc_retries``: allocations that had to free cached memory and retry; segments).

    python bench/interleave_probe.py [--model mixtral] [--layers 8] [--models 3] [--steps 160] --out FILE
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

from tiers.tools import measure  # noqa: E402


def allocator(device) -> dict:
    s = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return {k: s.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "segment.all.current",
                                     "reserved_bytes.all.current", "allocated_bytes.all.current")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--models", type=int, default=3, help="models resident (the first two step in turn)")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = measure.SHAPES if device.type == "cuda" else measure.TINY
    shape = dict(shapes[args.model], layers=args.layers)
    models = [measure.build(args.model, shape, device, seed=i) for i in range(args.models)]
    prompt = torch.randint(0, models[0].config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    pair = models[:2]
    result = {"command": "python bench/interleave_probe.py " + " ".join(sys.argv[1:]), "shape": shape, "device": str(device), "runs": {}}
    for name in ("alternate", "blocks", "gcoff", "alternate_again"):
        before = allocator(device)
        was = gc.isenabled()
        if name == "gcoff":
            gc.disable()
        try:
            if name == "blocks":
                times = [[], []]
                for _ in range(args.steps // 8):
                    for i in (0, 1):
                        times[i] += measure.interleaved_decode(pair[i : i + 1], prompt, 8, device, skip=0)[0]
            else:
                times = measure.interleaved_decode(pair, prompt, args.steps, device)
        finally:
            if was:
                gc.enable()
        after = allocator(device)
        ms = [[round(x * 1e3, 2) for x in t] for t in times]
        result["runs"][name] = {"step_ms": ms, "median_ms": [statistics.median(t) for t in ms], "mean_ms": [statistics.fmean(t) for t in ms],
                                "allocator_before": before, "allocator_after": after}
        print(name, [round(statistics.fmean(t), 2) for t in ms], [round(statistics.median(t), 2) for t in ms],
              {k: after[k] - before[k] for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}, flush=True)
    measure.write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
