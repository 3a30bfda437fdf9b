"""How fast and how close the rebalancer brings the hot set to a skewed trace's popular experts.

    python experiments/hot_converge.py [--model qwen3_moe] [--layers 12] [--experts 128] [--top-k 8]
                                 [--fractions 0.25,0.5] [--configs 2:4:0,auto:64,8:64:3:8] [--generates 24]
                                 [--tokens 33] [--every 8] [--reload N] --out FILE

For each GPU fraction and each config ``BUFFERS:WINDOW[:SIGNIFICANCE[:MAX_MOVES]]`` (``BUFFERS``:
promotion buffers, a number or ``auto`` for the library's own count; ``WINDOW``:
``tiers.rebalance.window``; ``SIGNIFICANCE``: ``tiers.rebalance.significance`` and ``MAX_MOVES``:
``tiers.rebalance.max_moves``, the library's defaults when left out), this
loads a model of the given layer and expert counts (tiny hidden sizes: the plan does not depend
on them) with the rebalancer on every ``--every`` tokens, routes ``--generates`` generates of
``--tokens`` tokens by the bench's skewed trace, and records after each generate: the hot
set's *coverage* (the mean over layers of the trace's popularity its hot experts hold; 1 is
every pick hot), the promotions that generate made, and its hit rate (hot experts and the
staging cache, as served on the CPU). ``best_coverage`` is the most a hot set of the same count
per layer can hold: each layer's most popular experts.

``--reload N``: after the generates, save the routing the rebalancer counted
(``tiers.save_routing``), load a fresh model with it (``tiers.load(..., routing=)``) and record
its coverage at load and over N generates (``reloaded``): how much of the settling a routing file
saves a new process.

Runs on the CPU unless ``--device cuda``: the plan is the same, only the decode path differs.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402


def parse_configs(text: str) -> list[tuple[int | None, int, float | None, int | None]]:
    """``BUFFERS:WINDOW[:SIGNIFICANCE[:MAX_MOVES]],...`` as (buffers or None for ``auto``, window,
    significance and max_moves or None for the defaults); refuses anything else."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) not in (2, 3, 4):
            raise SystemExit(f"--configs: {item!r} is not BUFFERS:WINDOW[:SIGNIFICANCE[:MAX_MOVES]]")
        try:
            n = None if parts[0] == "auto" else int(parts[0])
            w = int(parts[1])
            z = float(parts[2]) if len(parts) >= 3 else None
            moves = int(parts[3]) if len(parts) == 4 else None
        except ValueError:
            raise SystemExit(f"--configs: {item!r}: BUFFERS is a number or 'auto', WINDOW, SIGNIFICANCE and MAX_MOVES numbers") from None
        if (n is not None and n < 1) or w < 1 or (z is not None and z < 0) or (moves is not None and moves < 1):
            raise SystemExit(f"--configs: {item!r}: BUFFERS, WINDOW and MAX_MOVES must be at least 1, SIGNIFICANCE at least 0")
        out.append((n, w, z, moves))
    return out


def coverage(table, popularity: torch.Tensor, layers: list[int]) -> tuple[float, float]:
    """(the hot set's coverage, the best coverage of as many hot experts per layer): ``popularity``
    is ``[len(layers), experts]``, row i for ``layers[i]``, each row summing to 1."""
    got, best = 0.0, 0.0
    for i, L in enumerate(layers):
        hot = [k.expert for k, r in table.items() if k.layer == L and r.pinned]
        got += float(popularity[i, hot].sum()) if hot else 0.0
        best += float(popularity[i].sort(descending=True).values[: len(hot)].sum())
    return got / len(layers), best / len(layers)


def converge(packed, budget: int, fraction: float, buffers: int | None, window: int, significance: float | None = None,
             max_moves: int | None = None, *, every: int, generates: int, tokens: int, vocab: int, device: torch.device,
             routing=None, reload: int = 0) -> dict:
    import tiers
    from tiers.integration import manager_of
    from tiers.rebalance import Rebalancer
    from tiers.tools.routing import TraceRouting

    cfg = {"tiers": {"gpu": {"fraction": fraction}, "cpu": {"budget": budget, "precision": "int8"}, "nvme": {"precision": "int8"},
                     "rebalance": {"every_tokens": every, "window": window} | ({} if significance is None else {"significance": significance})
                     | ({} if max_moves is None else {"max_moves": max_moves})}}
    count = Rebalancer.buffer_count
    if buffers is not None:
        Rebalancer.buffer_count = classmethod(lambda cls, manifest, cfg: buffers)
    try:
        m = tiers.load(packed, cfg, device=device, progress=False, routing=routing)
    finally:
        Rebalancer.buffer_count = count
    mgr = manager_of(m)
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=tokens, min_new_tokens=tokens)
    row = {"buffers": len(mgr.rebalancer.buffers), "window": window, "significance": mgr.cfg.rebalance.significance,
           "max_moves": mgr.cfg.rebalance.max_moves, "generates": []}
    with TraceRouting(m, tokens=4096) as trace:
        popularity = trace.popularity()
        row["coverage_at_load"], row["best_coverage"] = coverage(mgr.table, popularity, trace.layers)
        for _ in range(generates):
            mgr.reset_stats()
            before = mgr.rebalancer.counts["promoted_hot"]
            m.generate(prompt, **kw)
            row["generates"].append({"coverage": coverage(mgr.table, popularity, trace.layers)[0],
                                     "promoted_hot": mgr.rebalancer.counts["promoted_hot"] - before,
                                     "hit_rate": mgr.stats().gpu_hit_rate})
    row["rebalancer"] = mgr.rebalancer.report()
    if reload:  # a new process that starts from the routing this one counted
        doc = tiers.routing_counts(m)
        mgr.close()
        again = converge(packed, budget, fraction, buffers, window, significance, max_moves, every=every, generates=reload,
                         tokens=tokens, vocab=vocab, device=device, routing=doc)
        row["reloaded"] = {"routing_tokens": doc["tokens"], "coverage_at_load": again["coverage_at_load"], "generates": again["generates"]}
        return row
    mgr.close()
    return row


def main() -> int:
    from tiers.tools.measure import add_counts_args, build_counts_model, fractions_of, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_counts_args(ap, generates=24)
    ap.add_argument("--configs", default="2:4:0,auto:64", help="BUFFERS:WINDOW[:SIGNIFICANCE[:MAX_MOVES]],... (BUFFERS a number or 'auto')")
    ap.add_argument("--reload", type=int, default=0, metavar="N",
                    help="then load again from the routing counted (tiers.save_routing) and record N generates")
    args = ap.parse_args()
    fractions = fractions_of(args.fractions)
    configs = parse_configs(args.configs)
    device = torch.device(args.device)
    shape, packed, budget = build_counts_model(args, "tiers-converge-")
    result = {"command": "python experiments/hot_converge.py " + " ".join(sys.argv[1:]), "shape": shape, "device": str(device),
              "every_tokens": args.every, "tokens_per_generate": args.tokens, "runs": []}
    for f in fractions:
        for (buffers, window, significance, max_moves), spec in zip(configs, args.configs.split(",")):
            row = converge(packed, budget, f, buffers, window, significance, max_moves, every=args.every, generates=args.generates,
                           tokens=args.tokens, vocab=shape["vocab_size"], device=device, reload=args.reload)
            row = {"fraction": f, "config": spec} | row
            result["runs"].append(row)
            last = row["generates"][-1]
            print(f, row["config"], json.dumps({"buffers": row["buffers"], "best": round(row["best_coverage"], 3),
                                                "coverage": [round(g["coverage"], 3) for g in row["generates"]],
                                                "last_hit_rate": round(last["hit_rate"], 3)}
                                               | ({"reloaded_at_load": round(row["reloaded"]["coverage_at_load"], 3)} if "reloaded" in row else {})),
                  flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
