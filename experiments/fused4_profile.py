"""Where does a Mixtral-shaped decode step with every expert int4 hot spend its GPU time, against every expert hot in bf16?

    PYTHONPATH=. python3 experiments/fused4_profile.py [--layers 2] [--tokens 16] [--out FILE]

On a CUDA machine. A Mixtral-8x7B-shaped model of ``--layers`` layers (random weights), packed in
bf16 and int4, loaded all hot in bf16 and at 30% with int4 hot; each generates ``--tokens`` decode
tokens after a warm-up under torch's profiler: the CUDA kernels' total times, the decode ms/token,
and which layers ran direct with fused products.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--fraction", type=float, default=0.3, help="the int4-hot arm's GPU budget, of the bf16 expert bytes")
    ap.add_argument("--out", default="experiments/results/fused4_profile.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the script's own check")
    args = ap.parse_args()
    import traceback

    import tiers
    from tiers.api import manager_of
    from tiers.graphs import graph_cache

    graph_cache.log.warning = lambda msg, *a: (print("CAPTURE FAILED:", msg % a), traceback.print_exc())
    from tiers.loader.pack import pack
    from tiers.tools.measure import SHAPES, TINY, build

    shape = dict((TINY if args.smoke else SHAPES)["mixtral"], layers=args.layers)
    device = "cpu" if args.smoke else "cuda"
    sync = (lambda: None) if args.smoke else torch.cuda.synchronize
    work = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    model = build("mixtral", shape, torch.device(device))
    model.save_pretrained(work / "hf")
    del model
    pack(work / "hf", work / "packed", precisions=("bf16", "int4"), progress=False, device=device)
    arms = {"bf16_all_hot": {"tiers": {"gpu": {"fraction": 1.0}, "cpu": {"precision": "bf16"}, "nvme": {"precision": "bf16"}}},
            "int4_hot": {"tiers": {"gpu": {"fraction": args.fraction, "precision": "int4"}, "cpu": {"precision": "int4"},
                                      "nvme": {"precision": "int4"}}}}
    prompt = torch.randint(3, 100, (1, 16), device=device)
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    result = {"command": f"python3 experiments/fused4_profile.py --layers {args.layers} --tokens {args.tokens}", "arms": {}}
    for name, cfg in arms.items():
        m = tiers.load(work / "packed", cfg, device=device, progress=False)
        mgr = manager_of(m)
        m.generate(prompt, **kw)
        sync()
        t = time.perf_counter()
        m.generate(prompt, **kw)
        sync()
        ms = (time.perf_counter() - t) * 1e3 / args.tokens
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU if args.smoke else torch.profiler.ProfilerActivity.CUDA]) as prof:
            m.generate(prompt, **kw)
            sync()
        rows = sorted(((e.key[:90], e.device_time_total / 1e3, e.count) for e in prof.key_averages()), key=lambda r: -r[1])[:14]
        layers = {L: (d.fused is not None) for L, d in (mgr.direct.layers or {}).items()}
        alone = {}
        for L, d in (mgr.direct.layers or {}).items():  # the fused products alone, on the model's own tensors
            if d.fused is None or args.smoke:
                continue
            from tiers.quant import fused4

            up, down = d.fused
            picks = torch.tensor([0, 1], device=device)
            x = torch.randn(1, up.cols_n).to(device, torch.bfloat16)
            h = torch.randn(2, down.cols_n).to(device, torch.bfloat16)
            for name, call in (("up", lambda: fused4.linear(x, 2, picks, d.starts, mgr.gpu_pool.slab, up)),
                               ("down", lambda: fused4.linear(h, 1, picks, d.starts, mgr.gpu_pool.slab, down))):
                call()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(20):
                    call()
                b.record()
                b.synchronize()
                alone[f"{L}.{name}"] = a.elapsed_time(b) / 20
            alone[f"{L}.starts"] = d.starts.tolist()
            break
        g = mgr.placement.groups[0]
        arm = {"ms_per_token_with_prefill": ms, "kernels_ms_count": rows, "direct_layers_fused": layers,
               "staging_slots": g.staging, "fused_alone_ms": alone, "gpu_pool": len(mgr.placement.gpu_pool), "stats_direct": tiers.stats(m).direct, "step_graph_cache": mgr.steps.graphs.counts() if mgr.steps is not None else None}
        result["arms"][name] = arm
        print(name, json.dumps(arm, default=str), flush=True)
        del m, mgr
        if not args.smoke:
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
