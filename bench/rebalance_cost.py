"""What the rebalancer costs the serving thread per decode token, step by step.

    python bench/rebalance_cost.py [--model qwen3_moe] [--layers 12] [--experts 128] [--top-k 8]
                                   [--fractions 0.25,0.5] [--generates 8] [--timed 4] [--tokens 33]
                                   [--every 8] --out FILE

Loads a model of the given layer and expert counts (tiny hidden sizes: the rebalancer's host work
depends on the counts, not on them) with the rebalancer on every ``--every`` tokens, routes it by
the bench's skewed trace in generate's decode stage with direct decode and decode graphs forced
on (the torch reference and ``HostGraph`` stand in for the kernel and CUDA graphs on the CPU),
generates ``--generates`` times as a warm-up and then times ``--timed`` generates with wall
clocks around the serving thread's rebalancer steps:

- ``note_first``: ``Rebalancer.note_call`` at a forward's first layer (lands finished moves,
  takes direct decode's counts when an interval closes, plans and issues a rebalance), with its
  parts ``land``, ``take_direct_usage``, ``rebalance`` (the plan and the issue of its moves,
  ``_issue`` among them) and ``_finish_hot`` (a hot swap landing);
- ``note_other``: ``note_call`` at every other layer (counting);
- ``_refresh_direct``: direct decode's tables rewritten after swaps.

Each as ms per decode token and calls, with the promotions made while timed and the generates'
wall ms per token. Runs on the CPU unless ``--device cuda`` (then the real kernel and graphs).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

def measure(packed, budget: int, fraction: float, *, every: int, generates: int, timed: int, tokens: int, vocab: int,
            device: torch.device, staging: int | str = "auto") -> dict:
    import tiers
    from tiers.graphs import DecodeGraphs
    from tiers.integration import manager_of
    from tiers.tools.measure import Steps
    from tiers.tools.routing import TraceRouting

    cfg = {"tiers": {"gpu": {"fraction": fraction, "staging_slots": staging}, "cpu": {"budget": budget, "precision": "int8"}, "nvme": {"precision": "int8"},
                     "rebalance": {"every_tokens": every}}}
    m = tiers.load(packed, cfg, device=device, progress=False)
    mgr = manager_of(m)
    if device.type == "cpu":  # what a GPU runs, with the torch reference and HostGraph standing in
        mgr.batched_decode = mgr.direct_decode = True
        mgr.graphs = DecodeGraphs(device, True)
    rb = mgr.rebalancer
    clock = Steps()
    for name in ("land", "rebalance", "_issue", "_finish_hot"):
        clock.wrap(rb, name, name)
    for name in ("take_direct_usage", "_refresh_direct"):
        clock.wrap(mgr, name, name)
    clock.wrap(rb, "note_call", "note_call", split=lambda a, k: "note_first" if (k["first"] if "first" in k else a[3]) else "note_other")
    prompt = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=tokens, min_new_tokens=tokens)
    with TraceRouting(m, tokens=4096):
        for _ in range(generates):
            m.generate(prompt, **kw)
        clock.clear()
        before = dict(rb.counts)
        t0 = time.perf_counter()
        for _ in range(timed):
            m.generate(prompt, **kw)
        wall = time.perf_counter() - t0
    clock.restore()
    n = timed * tokens
    row = {"fraction": fraction, "tokens_timed": n, "wall_ms_per_token": wall / n * 1e3,
           "promoted_hot": rb.counts["promoted_hot"] - before["promoted_hot"], "rebalances": rb.counts["rebalances"] - before["rebalances"],
           "steps_ms_per_token": {k: v / n for k, v in sorted(clock.ms.items(), key=lambda kv: -kv[1])},
           "calls": dict(clock.calls), "decode_graphs": mgr.graphs.counts(), "direct_calls": mgr.stats_.direct_calls}
    row["serving_ms_per_token"] = sum(row["steps_ms_per_token"].get(k, 0.0) for k in ("note_first", "note_other", "_refresh_direct"))
    mgr.close()
    return row


def main() -> int:
    from tiers.tools.measure import add_counts_args, build_counts_model, fractions_of, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_counts_args(ap, generates=8)
    ap.add_argument("--timed", type=int, default=4, help="generates timed after the warm-up ones")
    args = ap.parse_args()
    fractions = fractions_of(args.fractions)
    device = torch.device(args.device)
    shape, packed, budget = build_counts_model(args, "tiers-rebalance-cost-")
    result = {"command": "python bench/rebalance_cost.py " + " ".join(sys.argv[1:]), "shape": shape, "device": str(device),
              "every_tokens": args.every, "runs": []}
    for f in fractions:
        row = measure(packed, budget, f, every=args.every, generates=args.generates, timed=args.timed, tokens=args.tokens,
                      vocab=shape["vocab_size"], device=device)
        result["runs"].append(row)
        print(f, json.dumps({"serving_ms_per_token": round(row["serving_ms_per_token"], 3), "promoted_hot": row["promoted_hot"],
                             "steps": {k: round(v, 3) for k, v in row["steps_ms_per_token"].items()}}), flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
