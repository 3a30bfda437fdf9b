"""Where does a host-routed decode layer call's time go, beside its copies?

    PYTHONPATH=. python3 experiments/decode_marks.py [--model mixtral] [--layers 4] [--tokens 16]
                                                     [--arms tiers_25_int4,tiers_25_int4~direct] --out FILE

On a CUDA machine. Builds the model's shapes with random weights, packs the arms' precisions and
loads each arm as ``tools/bench.py`` does (``tools.bench_arms.tiers_config``). For each arm, the
decode ms/token of generate (median of 3, graphs as configured), then one generate with marks
(``tools.timeline.Marks``: host clock and CUDA events), per host-routed layer call of each decode
token after the first:

- ``sync_ms``: host time from the experts call's start to the routing sync's return;
- ``plan_ms``: host time from there to the first copy queued (cache, table, staging decisions);
- ``queue_ms``: host time from there to the call's end (the rest of the copies, kernels queued);
- ``gpu_idle_ms``: device time from the routing's end (the experts call's start on the compute
  stream) to the first copy's queueing on the copy stream, when neither engine works;
- ``copy_ms``: device time from that to the copy stream's end of the call's copies;
- ``tail_ms``: device time from the copies' end to the experts call's end (the last tensor's
  decode and the experts' products);
- ``between_ms``: device time from a call's end to the next call's start (the next layer's
  attention, norms and router).

``~direct`` arms run every decode stage direct (``DirectPath.MISS_BYTES`` unbounded); their step
graphs hide the layers, so they are timed as a whole unless ``~nograph`` turns graphs off. Then
each direct call gives ``fetch_ms`` (device time of its plan and fetch launches, which read its
misses), ``products_ms`` (from there to the call's end) and ``between_ms``; the rate of the
fetches is the arm's bytes per call over ``fetch_ms`` (``fetch_gb_s``).
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402


def instrument(model, mgr, marks) -> list:
    """Marks of each host-routed call: the experts call's start and end, the sync's return, the
    first copy queued and the batch's close (copy stream); returns the undo callables."""
    from tiers.tools.timeline import hook_layers, wrap_call

    undo = hook_layers(model, marks)
    staging = mgr.staging
    first = [True]

    def routed(*_a, **_k):
        marks.mark("routed", marks.layer)
        first[0] = True

    def write(*_a, **_k):
        if first[0]:
            marks.mark("copy_q", marks.layer, staging.copy_stream)
            first[0] = False

    def mark(what: str, stream=None):
        return lambda *_a, **_k: marks.mark(what, marks.layer, stream)

    undo += [wrap_call(mgr, "count_call", before=routed),
             wrap_call(mgr.direct, "_fetch", before=mark("fetch"), after=mark("fetch_end")),
             wrap_call(staging, "write", before=write),
             wrap_call(staging, "_close", after=mark("copy_end", staging.copy_stream))]
    return undo


def split(resolved: list, layers: int) -> dict:
    """Medians over the host-routed calls of the tokens after the first, as the module docstring says."""
    tokens, cur = [], None
    for w, L, h, d in resolved:
        if w == "layer" and L == 0:
            cur = []
            tokens.append(cur)
        if cur is not None:
            cur.append((w, L, h, d))
    rows = []
    for tok in tokens[1:]:
        by = {}
        for w, L, h, d in tok:
            by.setdefault(L, {}).setdefault(w, (h, d))
        for L in range(layers):
            m = by.get(L, {})
            if all(k in m for k in ("experts", "routed", "copy_q", "copy_end", "experts_end")):  # host-routed
                row = {"sync_ms": m["routed"][0] - m["experts"][0], "plan_ms": m["copy_q"][0] - m["routed"][0],
                       "queue_ms": m["experts_end"][0] - m["copy_q"][0], "gpu_idle_ms": m["copy_q"][1] - m["experts"][1],
                       "copy_ms": m["copy_end"][1] - m["copy_q"][1], "tail_ms": m["experts_end"][1] - m["copy_end"][1]}
            elif all(k in m for k in ("experts", "fetch", "fetch_end", "experts_end")):  # direct, graphs off
                row = {"fetch_ms": m["fetch_end"][1] - m["fetch"][1], "products_ms": m["experts_end"][1] - m["fetch_end"][1]}
            else:
                continue
            nxt = by.get(L + 1, {}).get("experts")
            if nxt is not None:
                row["between_ms"] = nxt[1] - m["experts_end"][1]
            rows.append(row)
    if not rows:
        return {"calls": 0}
    keys = sorted({k for r in rows for k in r})
    return {"calls": len(rows)} | {k: round(statistics.median(r[k] for r in rows if k in r), 4) for k in keys}


def run_arm(name: str, args, packed: Path, expert_bytes: int, prompt, top_k: int, device: torch.device) -> dict:
    import tiers
    from tiers.api import manager_of
    from tiers.paths.direct import DirectPath
    from tiers.tools.bench_arms import tiers_config
    from tiers.tools.measure import decode_ms_per_token
    from tiers.tools.timeline import Marks

    base, _, variant = name.partition("~")
    flags = SimpleNamespace(staging_slots="auto", graphs="on", rebalance_every=0)
    cfg = tiers_config(base, flags, expert_bytes, packed, top_k)
    was = DirectPath.MISS_BYTES
    variants = set(variant.split("~")) - {""}
    if "nograph" in variants:
        cfg["tiers"]["gpu"]["graphs"] = False
    if "direct" in variants:
        DirectPath.MISS_BYTES = float("inf")
    try:
        m = tiers.load(packed, cfg, device=device, progress=False)
        mgr = manager_of(m)
        if device.type == "cpu" and "direct" in variants:  # a smoke run: the torch reference stands in for the kernel
            mgr.batched_decode = mgr.staging.direct_reads = mgr.direct.enabled = True
        m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        ms = decode_ms_per_token(m, prompt, args.tokens, device, 3)
        mgr.reset_stats()
        m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
        moved = sum(tiers.stats(m).bytes_moved.values()) / args.tokens
        row = {"decode_ms_per_token": round(ms, 3), "mib_moved_per_token": round(moved / 2**20, 1),
               "bytes_ms_per_token": round(moved / 55e9 * 1e3, 3)}
        if "direct" not in variants or "nograph" in variants:
            marks = Marks(device.type == "cuda")
            undo = instrument(m, mgr, marks)
            marks.on = True
            m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
            marks.on = False
            for u in reversed(undo):
                u()
            row["calls"] = split(marks.resolved(), args.layers)
            if row["calls"].get("fetch_ms", 0) > 0:
                row["fetch_gb_s"] = round(moved / args.layers / row["calls"]["fetch_ms"] / 1e6, 1)
        mgr.close()
        return row
    finally:
        DirectPath.MISS_BYTES = was


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--arms", default="tiers_100_bf16,tiers_25_int4,tiers_25_int4~direct")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a smoke run of the script itself")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")

    from tiers.loader.pack import pack
    from tiers.tools.bench_arms import arm_precisions
    from tiers.tools.measure import SHAPES, TINY, build, expert_bytes_of, write_result

    shape = dict((TINY if args.tiny else SHAPES)[args.model], layers=args.layers)
    model = build(args.model, shape, device)
    expert_bytes, top_k = expert_bytes_of(model), model.config.num_experts_per_tok
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    arms = args.arms.split(",")
    work = Path(tempfile.mkdtemp(prefix="tiers-marks-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    model.save_pretrained(work / "hf")
    del model
    pack(work / "hf", work / "packed", precisions=arm_precisions([a.split("~")[0] for a in arms]), overwrite=True, progress=False,
         device=device)
    result = {"command": "python3 experiments/decode_marks.py " + " ".join(sys.argv[1:]), "model": args.model, "shape": shape,
              "device": str(device) if args.tiny else torch.cuda.get_device_name(), "arms": {}}
    for name in arms:
        result["arms"][name] = run_arm(name, args, work / "packed", expert_bytes, prompt, top_k, device)
        print(name, result["arms"][name], flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
