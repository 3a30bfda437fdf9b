"""Why a Tiers model whose experts are all hot decodes slower than the untiered one on a GPU.

    python bench/static_check.py [--model qwen3_moe] [--layers 6]

Loads the all-GPU model and Tiers at a 100% budget side by side, times decode alternately, counts
which experts forward ran in decode, and cProfiles one decode generate of each.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    import tiers
    import tiers.integration as integ
    import transformers.integrations.moe as moe
    from tiers.loader.pack import pack
    from tiers.integration import manager_of
    from tiers.tools.measure import SHAPES, TINY, build, decode_ms_per_token, scratch_dir

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = scratch_dir("tiers-static-")
    shape = dict((SHAPES if torch.cuda.is_available() else TINY)[args.model], layers=args.layers)
    plain = build(args.model, shape, device)
    plain.save_pretrained(work / "hf")
    pack(work / "hf", work / "packed", precisions=["bf16"], overwrite=True, progress=False, device=device)
    m = tiers.load(work / "packed", {"tiers": {"gpu": {"fraction": 1.0}}}, device=device, progress=False)
    mgr = manager_of(m)
    print("attn", plain.config._attn_implementation, m.config._attn_implementation, "experts", plain.config._experts_implementation,
          m.config._experts_implementation, "static", len(mgr.static_maps), "views", len(mgr.static_views), "batched_decode", mgr.batched_decode)
    print("gen", plain.generation_config.to_diff_dict(), m.generation_config.to_diff_dict())
    print("dtypes", {p.dtype for p in plain.parameters()}, {p.dtype for p in m.parameters()}, "training", plain.training, m.training)
    seen = {}
    for name in ("batched_mm_experts_forward", "grouped_mm_experts_forward"):
        for owner in (integ, moe):
            fn = getattr(owner, name)

            def spy(*a, _fn=fn, _k=f"{owner.__name__.split('.')[-1]}.{name}"):
                seen[(_k, mgr.decoding)] = seen.get((_k, mgr.decoding), 0) + 1
                return _fn(*a)
            setattr(owner, name, spy)
    moe.ALL_EXPERTS_FUNCTIONS["batched_mm"] = moe.batched_mm_experts_forward
    moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"] = moe.grouped_mm_experts_forward
    prompt = torch.randint(0, plain.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    kw = dict(do_sample=False, pad_token_id=0)
    for model in (plain, m):
        model.generate(prompt, max_new_tokens=16, min_new_tokens=16, **kw)
    for rep in range(3):
        for name, model in (("plain", plain), ("tiers", m)):
            seen.clear()
            ms = decode_ms_per_token(model, prompt, 16, device, 2)
            print(rep, name, f"{ms:.2f} ms/token", dict(seen))
    for name, model in (("plain", plain), ("tiers", m)):
        pr = cProfile.Profile()
        with torch.no_grad():
            pr.enable()
            model.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kw)
            torch.cuda.synchronize() if device.type == "cuda" else None
            pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(40)
        print(f"== {name} ==\n" + buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
