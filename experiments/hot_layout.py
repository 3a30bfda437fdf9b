"""Where the rebalancer leaves the hot experts: per layer, how many, and in how many runs of slots.

    python experiments/hot_layout.py [--model qwen3_moe] [--layers 12] [--experts 128] [--top-k 8]
                               [--fractions 0.25,0.5] [--generates 8] [--tokens 33] [--every 8]
                               [--prefill 2048] [--modes own,across] --out FILE

A whole-layer call runs one grouped GEMM per run of its layer's hot slots (``tiers.integration``'s
``_slot_runs``), and its copies are the layer's warm experts, so both the runs and an even
spread of hot experts over the layers decide what a prefill costs after the rebalancer has
moved experts. This builds a model of the given layer and expert counts (tiny hidden sizes:
the plan and the slots do not depend on them), packs it, and for each GPU fraction loads it with
the rebalancer on (every ``--every`` tokens), routes ``--generates`` generates of ``--tokens``
tokens by the bench's skewed trace, and reports per layer the hot experts and their slot runs,
at load and after, with the rebalancer's counts and the GPU hit rate of four more generates;
also the runs of each layer's warm host places that lie back to back, and (``--prefill N``, 0:
off) the host-to-GPU copies and the dequantization launches one forward of N tokens queues, at
load and after (routed by the trace too, so the trace's rows shift by N): a streamed part copies
each run of its reads at once and dequantizes each run of its slots at once. ``--modes`` runs each
fraction once per mode of the rebalancer's hot moves (``own``: a newcomer replaces an expert of
its own layer, the default; ``across``: of any layer, ``tiers.rebalance.across_layers``); each
row also has the GPU hit rate of every four generates (``gpu_hit_rate_per_4``).

Runs on the CPU unless ``--device cuda``: the plan is the same, only the decode path differs.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402


def layout_summary(table, layers: list[int], num_experts: int, place: int | None = None) -> dict:
    """Per layer (in ``layers`` order): the hot experts' count and their slots' runs; with
    ``place`` (bytes from one warm place to the next, a transit row), also the runs of the warm
    experts' host places lying back to back, each one copy when a streamed part reads them all."""
    from tiers.loader.layout import ExpertKey
    from tiers.integration import _slot_runs

    hot, runs, warm_runs = [], [], []
    for L in layers:
        rows = [table[ExpertKey(L, e)] for e in range(num_experts)]
        slots = sorted(r.slot for r in rows if r.pinned)
        hot.append(len(slots))
        runs.append(len(_slot_runs(slots)))
        offs = sorted(r.host_offset for r in rows if r.host_offset is not None)
        warm_runs.append(sum(i == 0 or o != offs[i - 1] + place for i, o in enumerate(offs)) if place else 0)
    out = {"hot_per_layer": hot, "slot_runs_per_layer": runs}
    return out | ({"warm_place_runs_per_layer": warm_runs} if place else {})


def prefill_counts(model, ids) -> dict:
    """What one forward of ``ids`` queues: ``copies``, the host-to-GPU copies of expert bytes
    (each is checked for a pinned source once, ``_check_pinned``; on CUDA the index uploads are
    checked too), and ``dequantizations``, the launches of the cpu tier's dequantization (one per
    tensor of each run of slots a stack fills in a row, one per tensor of a lone slot)."""
    from tiers import quant
    from tiers.integration import manager_of

    mgr = manager_of(model)
    scheme = quant.get_scheme(mgr.cfg.cpu.precision)
    n = {"copies": 0, "dequantizations": 0}
    check, dequantize = mgr._check_pinned, scheme.dequantize

    def counted(src):
        n["copies"] += 1
        return check(src)

    def launched(q, out):
        n["dequantizations"] += 1
        return dequantize(q, out=out)

    mgr._check_pinned = counted
    scheme.dequantize = launched
    try:
        with torch.no_grad():
            model(ids)
    finally:
        del mgr._check_pinned
        del scheme.dequantize
    return n


def main() -> int:
    from tiers.tools.measure import add_counts_args, build_counts_model, fractions_of, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_counts_args(ap, generates=8)
    ap.add_argument("--prefill", type=int, default=2048, help="tokens of the forward whose copies are counted (0: none)")
    ap.add_argument("--modes", default="own", help="comma-separated: own (hot moves within a layer), across (across layers)")
    args = ap.parse_args()
    fractions = fractions_of(args.fractions)
    modes = args.modes.split(",")
    if not modes or any(m not in ("own", "across") for m in modes):
        ap.error(f"--modes: expected own and/or across, got {args.modes!r}")

    import tiers
    from tiers.integration import manager_of
    from tiers.tools.routing import TraceRouting

    device = torch.device(args.device)
    shape, packed, budget = build_counts_model(args, "tiers-layout-")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab_size"], (1, 16), generator=g).to(device)
    ids = torch.randint(0, shape["vocab_size"], (1, args.prefill), generator=g).to(device) if args.prefill else None
    kw = dict(do_sample=False, pad_token_id=0)
    result = {"command": "python experiments/hot_layout.py " + " ".join(sys.argv[1:]), "shape": shape, "device": str(device), "fractions": {}}
    for f, mode in [(f, mode) for f in fractions for mode in modes]:
        cfg = {"tiers": {"gpu": {"fraction": f}, "cpu": {"budget": budget, "precision": "int8"}, "nvme": {"precision": "int8"},
                         "rebalance": {"every_tokens": args.every, "across_layers": mode == "across"}}}
        m = tiers.load(packed, cfg, device=device, progress=False)
        mgr = manager_of(m)
        layers = sorted(mgr.manifest.layers)
        place = mgr.transit[id(mgr.pools[0])].shape[1]
        row = {"load": layout_summary(mgr.table, layers, args.experts, place)}
        with TraceRouting(m, tokens=4096):
            at_load = prefill_counts(m, ids) if ids is not None else None
            row["gpu_hit_rate_per_4"] = []
            for i in range(args.generates):
                if i % 4 == 0:
                    mgr.reset_stats()
                m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)
                if i % 4 == 3:
                    row["gpu_hit_rate_per_4"].append(mgr.stats().gpu_hit_rate)
            row["after"] = layout_summary(mgr.table, layers, args.experts, place)
            row["rebalancer"] = mgr.rebalancer.report()
            mgr.reset_stats()
            for _ in range(4):
                m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)
            hit_rate_after = mgr.stats().gpu_hit_rate
            if ids is not None:
                after = prefill_counts(m, ids)
                row["prefill_copies"] = {"load": at_load["copies"], "after": after["copies"]}
                row["prefill_dequantizations"] = {"load": at_load["dequantizations"], "after": after["dequantizations"]}
        row["gpu_hit_rate_after"] = hit_rate_after
        result["fractions"][str(f) if modes == ["own"] else f"{f}:{mode}"] = row
        print(f, mode, json.dumps(row), flush=True)
        mgr.close()
        del m
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
