"""The rebalancer's effect on GPU hits, isolated: the same skewed routing, rebalancer off and on.

    python bench/rebalance_ab.py [--tokens 256] [--out bench/results/rebalance_ab.json]

A random-weight model with Mixtral-8x7B's expert counts (8 MoE layers x 8 experts, top-2) but
tiny matrices is routed by the skewed, sticky trace of the timed bench (``tools.routing``), and
served by Tiers at 25% and 50% GPU budgets with the rebalancer off and on. Hits and bytes depend
on the counts, not on the matrix sizes, so the CPU is enough; bytes are reported as experts
moved per token. Time is not measured here (see ``tools/bench.py`` on a GPU).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256, layers=8)


def run(tokens: int, every: int, fractions=(0.25, 0.5), seed: int = 0) -> dict:
    import tiers
    from tiers.loader.pack import pack
    from tiers.integration import manager_of
    from tiers.tools.measure import build
    from tiers.tools.routing import TraceRouting

    from tiers.tools.measure import scratch_dir, write_result

    work = scratch_dir("tiers-ab-")
    model = build("mixtral", dict(SHAPE), torch.device("cpu"))
    model.save_pretrained(work / "hf")
    pack(work / "hf", work / "packed", precisions=["bf16", "int8"], progress=False)
    prompt = torch.tensor([[1, 2, 3, 4]])
    rows = []
    arms = [(f, e) for f in fractions for e in (0, every)]
    for frac, rebalance_every in tqdm(arms, desc="rebalance a/b", unit="arm"):
        cfg = {"tiers": {"gpu": {"fraction": frac, "staging_slots": 4}, "cpu": {"fraction": 1.0 - frac},
                         "rebalance": {"every_tokens": rebalance_every}}}
        m = tiers.load(work / "packed", cfg, device="cpu", progress=False)
        mgr = manager_of(m)
        with TraceRouting(m, seed=seed, tokens=4 * tokens):
            kw = dict(do_sample=False, pad_token_id=0)
            m.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, **kw)  # warm-up: the rebalancer's first rounds
            mgr.reset_stats()
            m.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
            s = mgr.stats()
        expert_int8 = next(iter(mgr.manifest.layers.values())).blobs["int8"].nbytes
        rows.append({
            "gpu_fraction": frac, "rebalance_every_tokens": rebalance_every, "tokens": tokens,
            "gpu_hit_rate": s.gpu_hit_rate,
            "experts_moved_per_token": s.bytes_moved.get("cpu", 0) / expert_int8 / tokens,
            # hot promotions' copies (bf16, about 2 INT8 experts each), in INT8 experts per token
            "promotion_int8_experts_per_token": s.bytes_moved.get("rebalance", 0) / expert_int8 / tokens,
            "hot_experts": s.gpu_slots["hot"], "rebalance": s.rebalance,
        })
        mgr.close()
    return {"command": "python bench/rebalance_ab.py " + " ".join(sys.argv[1:]), "shape": SHAPE,
            "routing": {"zipf_s": 1.2, "reuse_p": 0.5, "seed": seed}, "arms": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--every", type=int, default=8, help="rebalance every this many tokens in the 'on' arms")
    ap.add_argument("--out", default="bench/results/rebalance_ab.json")
    args = ap.parse_args(argv)
    r = run(args.tokens, args.every)
    write_result(args.out, r)
    for a in r["arms"]:
        print(f"gpu {a['gpu_fraction']:.0%} rebalance every {a['rebalance_every_tokens']:>3}: hit rate {a['gpu_hit_rate']:.3f}, "
              f"{a['experts_moved_per_token']:.2f} experts moved/token + {a['promotion_int8_experts_per_token']:.2f} (in int8 experts) "
              f"for {a['rebalance'].get('promoted_hot', 0)} promotions to gpu since load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
