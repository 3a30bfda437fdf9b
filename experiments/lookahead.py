"""Does lookahead prefetch (``tiers.gpu.prefetch_depth``) pay on a model trained on real text?

    PYTHONPATH=. python experiments/lookahead.py [--model ../shared/models/qwen3-moe-bytes-6m] [--out experiments/results/lookahead.json]

Lookahead applies the routers of the next ``depth`` MoE layers to this layer's experts input and
stages their top-k into free staging slots. It had only been measured on random-weight models,
whose routers are near uniform. This measures it on the trained byte-level Qwen3-MoE
(../shared/models/README.md: 6 MoE layers, 16 experts, top-2, learned skewed routing), on CPU:

1. Prediction (plain transformers, hooks on each experts module, bf16 as Tiers runs the dense
   weights): layer i+d's router on layer i's experts input, top-k of the logits, against the
   experts layer i+d used; d = 1, 2. Per layer call of 1 token (decode: |pred & used| / k),
   64 and 512 tokens (prefill: recall = share of the used experts that were predicted; waste =
   share of the predicted that went unused). Baselines that need no router: the experts the same
   layer used in the previous call (temporal reuse; for 1 token: the previous token) and the
   layer's most popular experts (counted on disjoint windows; as many as lookahead predicted).
2. Effect in Tiers: pack (bf16 + int8), load on the CPU with 25% of expert bytes as the "gpu"
   tier and every other expert int8 in the cpu tier, hot set round-robin (no routing) or by
   popularity (the routing prior counted in 1.), staging slots auto or 2; prefetch_depth 0, 1, 2;
   8 prompts of 64 bytes, each prefilled, then 64 greedy decode steps (batch 1), one model per
   arm serving the prompts in turn. Per decode step: lookups, GPU hit rate, bytes moved, of them
   prefetched bytes and on-demand bytes (moved for misses that stall: total - prefetched),
   prefetches issued / used / wasted (evicted unused). CPU copies are synchronous: on a GPU the
   win would be overlap of copies with compute, so the counts, not the CPU times, are the result.

Torch runs on one thread (two threads made each small bf16 op ~100x slower on the 2-core host).
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

WINDOW = 512
FIT_WINDOWS, TEST_WINDOWS = 48, 64  # evenly spaced in the first half of eval.txt (popularity), the second (scored)
CALL_SIZES = (1, 64, 512)
PROMPTS, PROMPT_BYTES, NEW_TOKENS = 8, 64, 64


def windows(data: bytes, lo: int, hi: int, n: int, size: int) -> list[bytes]:
    step = (hi - lo - size) // max(1, n - 1)
    return [data[lo + i * step : lo + i * step + size] for i in range(n)]


def capture(model, texts: list[bytes]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per text, per MoE layer: the experts input [T, H] and the routed experts [T, k]."""
    mods = [layer.mlp.experts for layer in model.model.layers]
    rec: list = []
    hooks = [m.register_forward_pre_hook(lambda _m, args, i=i: rec.__setitem__(i, (args[0].detach(), args[1].detach())))
             for i, m in enumerate(mods)]
    out = []
    with torch.no_grad():
        for t in texts:
            rec = [None] * len(mods)
            model(torch.tensor([list(t)]))
            out.append(rec)
    for h in hooks:
        h.remove()
    return out


def spec_sets(x: torch.Tensor, w: torch.Tensor, k: int, c: int) -> list[set]:
    """What the library predicts per call of ``c`` tokens: every expert some token's top-k of
    ``x @ w.T`` names (all of them once 0.9 of the layer is named, ``WHOLE_LAYER``)."""
    picks = torch.topk(x.to(w.dtype) @ w.t(), k, dim=-1).indices
    out = []
    for a in range(0, x.shape[0], c):
        s = set(picks[a : a + c].reshape(-1).tolist())
        out.append(set(range(w.shape[0])) if len(s) >= 0.9 * w.shape[0] else s)
    return out


def prediction(model, fit, test, k: int, n_exp: int) -> tuple[dict, dict]:
    L = len(test[0])
    routers = [layer.mlp.gate.weight.detach() for layer in model.model.layers]
    counts = torch.zeros(L, n_exp, dtype=torch.long)
    for rec in fit:
        for i, (_, idx) in enumerate(rec):
            counts[i] += torch.bincount(idx.reshape(-1), minlength=n_exp)
    popular = [counts[i].argsort(descending=True, stable=True).tolist() for i in range(L)]
    res = {}
    for c in CALL_SIZES:
        acc = {}  # predictor -> [sum recall, sum waste, sum |pred|, sum |used|, calls]
        per_pair, last = {}, {}
        for rec in test:
            for j in range(1, L):
                used = [set(rec[j][1][a : a + c].reshape(-1).tolist()) for a in range(0, WINDOW, c)]
                preds = {}
                for d in (1, 2):
                    if j - d >= 0:
                        preds[f"lookahead_d{d}"] = spec_sets(rec[j - d][0], routers[j], k, c)
                preds["temporal"] = [last.get(j)] + used[:-1]  # the previous call (1 token: the previous token), across windows
                last[j] = used[-1]
                preds["popular"] = [set(popular[j][: len(p)]) for p in preds["lookahead_d1"]]
                for name, ps in preds.items():
                    a = acc.setdefault(name, [0.0, 0.0, 0, 0, 0])
                    pp = per_pair.setdefault(f"{name}:layer{j}", [0.0, 0])
                    for p, u in zip(ps, used):
                        if p is None:
                            continue
                        hit = len(p & u)
                        a[0] += hit / len(u)
                        a[1] += (len(p) - hit) / len(p) if p else 0.0
                        a[2] += len(p)
                        a[3] += len(u)
                        a[4] += 1
                        pp[0] += hit / len(u)
                        pp[1] += 1
        res[str(c)] = {name: {"recall": a[0] / a[4], "waste": a[1] / a[4], "predicted": a[2] / a[4], "used": a[3] / a[4], "calls": a[4]}
                       for name, a in acc.items()}
        if c == 1:
            res["1"]["per_target_layer_recall"] = {n: round(v[0] / v[1], 4) for n, v in per_pair.items()}
    res["1"]["chance"] = k / n_exp
    top_quarter = [float(counts[i].sort(descending=True).values[: n_exp // 4].sum() / counts[i].sum()) for i in range(L)]
    res["top_quarter_share_of_lookups"] = top_quarter
    return res, {i: counts[i].tolist() for i in range(L)}


def snapshot(model) -> dict:
    import tiers
    from tiers.integration import manager_of
    s = tiers.stats(model).as_dict()
    st = manager_of(model).stats_
    p = s["prefetch"]
    return {"lookups": sum(s["hits"].values()), "gpu_hits": s["hits"]["gpu"], "bytes_moved": sum(s["bytes_moved"].values()),
            "prefetch_bytes": p["bytes"], "issued": p["issued"], "used": p["used"], "wasted_bytes": p["wasted_bytes"],
            "correct": st.prefetch_correct, "scored": st.prefetch_used_total, "stage_seconds": s["stage_seconds"]}


def per_token(a: dict, b: dict, steps: int, seconds: float | None = None) -> dict:
    d = {k: b[k] - a[k] for k in a}
    out = {"steps": steps, "lookups_per_step": d["lookups"] / steps, "gpu_hit_rate": d["gpu_hits"] / max(1, d["lookups"]),
           "demand_misses_per_step": (d["lookups"] - d["gpu_hits"]) / steps,
           "bytes_moved_per_step": d["bytes_moved"] / steps, "prefetch_bytes_per_step": d["prefetch_bytes"] / steps,
           "demand_bytes_per_step": (d["bytes_moved"] - d["prefetch_bytes"]) / steps,
           "prefetch_issued": d["issued"], "prefetch_used": d["used"], "prefetch_used_share": d["used"] / d["issued"] if d["issued"] else None,
           "wasted_bytes_per_step": d["wasted_bytes"] / steps,
           "prefetch_accuracy": d["correct"] / d["scored"] if d["scored"] else None, "cpu_stage_seconds": d["stage_seconds"]}
    if seconds is not None:
        out["cpu_ms_per_step"] = 1e3 * seconds / steps
    return out


def tiers_arm(packed: Path, prompts: list[bytes], gpu: dict, depth: int, routing: dict | None) -> dict:
    import tiers
    from tiers.integration import manager_of
    cfg = {"tiers": {"gpu": {**gpu, "prefetch_depth": depth}, "cpu": {"budget": "64MiB", "precision": "int8"}}}
    model = tiers.load(packed, cfg, device="cpu", progress=False, routing=routing)
    with torch.no_grad():  # one untimed warm-up call of each shape the arm runs, on a prompt of its own
        model(torch.tensor([list(b"warm-up " * 8)]))
    pre_total = dec_total = None
    seconds, texts = 0.0, []
    with torch.no_grad():
        for p in prompts:
            s0 = snapshot(model)
            out = model(torch.tensor([list(p)]), use_cache=True)
            s1 = snapshot(model)
            past, tok, gen = out.past_key_values, out.logits[0, -1].argmax(), []
            t0 = time.perf_counter()
            for _ in range(NEW_TOKENS):
                gen.append(int(tok))
                out = model(tok.view(1, 1), past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[0, -1].argmax()
            seconds += time.perf_counter() - t0
            s2 = snapshot(model)
            pre_total = {k: (pre_total or dict.fromkeys(s0, 0))[k] + s1[k] - s0[k] for k in s0}
            dec_total = {k: (dec_total or dict.fromkeys(s0, 0))[k] + s2[k] - s1[k] for k in s0}
            texts.append(bytes(gen).decode("utf-8", "replace"))
    zero = dict.fromkeys(pre_total, 0)
    st = tiers.stats(model).as_dict()
    mgr = manager_of(model)
    return {"config": cfg, "gpu_slots": st["gpu_slots"], "residency": st["residency"],
            "decode": per_token(zero, dec_total, PROMPTS * NEW_TOKENS, seconds),
            "prefill": per_token(zero, pre_total, PROMPTS),
            "prefetched_unresolved_at_end": len(mgr.prefetched), "texts": texts, "totals_as_dict": {k: st[k] for k in ("hits", "bytes_moved", "prefetch")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="../shared/models/qwen3-moe-bytes-6m")
    ap.add_argument("--out", default="experiments/results/lookahead.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from tiers.loader.pack import pack
    from tiers.loader.routing import routing_document

    src = Path(args.model)
    data = (src / "eval.txt").read_bytes()
    half = len(data) // 2
    fit_txt = windows(data, 0, half, FIT_WINDOWS, WINDOW)
    test_txt = windows(data, half, len(data), TEST_WINDOWS, WINDOW)
    prompts = [w[:PROMPT_BYTES] for w in windows(data, half + WINDOW // 2, len(data), PROMPTS, 2 * PROMPT_BYTES)]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    k, n_exp = model.config.num_experts_per_tok, model.config.num_experts
    t0 = time.perf_counter()
    pred, counts = prediction(model, capture(model, fit_txt), capture(model, test_txt), k, n_exp)
    print(json.dumps({c: {n: round(v["recall"], 4) for n, v in r.items() if isinstance(v, dict) and "recall" in v}
                      for c, r in pred.items() if c in map(str, CALL_SIZES)}), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    routing = routing_document(counts, FIT_WINDOWS * WINDOW)

    arms = {}
    with tempfile.TemporaryDirectory() as tmp:
        packed = Path(tmp) / "packed"
        pack(src, packed, precisions=["bf16", "int8"], progress=False)
        for placement, prior in (("round_robin", None), ("popular", routing)):
            for staging in ("auto", 2):
                for depth in (0, 1, 2):
                    name = f"{placement}/staging_{staging}/depth_{depth}"
                    t0 = time.perf_counter()
                    arms[name] = r = tiers_arm(packed, prompts, {"fraction": 0.25, "staging_slots": staging}, depth, prior)
                    d = r["decode"]
                    print(f"{name}: hit {d['gpu_hit_rate']:.3f} bytes/step {d['bytes_moved_per_step']:.0f} demand {d['demand_bytes_per_step']:.0f} "
                          f"wasted {d['wasted_bytes_per_step']:.0f} issued {d['prefetch_issued']} used {d['prefetch_used']} "
                          f"cpu {d['cpu_ms_per_step']:.1f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
    summary = {}
    for name, r in arms.items():
        base = arms[name.rsplit("/", 1)[0] + "/depth_0"]
        d, b = r["decode"], base["decode"]
        summary[name] = {"gpu_hit_rate": round(d["gpu_hit_rate"], 4), "bytes_moved_per_step": round(d["bytes_moved_per_step"]),
                         "demand_bytes_per_step": round(d["demand_bytes_per_step"]), "wasted_bytes_per_step": round(d["wasted_bytes_per_step"]),
                         "demand_bytes_saved_per_step": round(b["demand_bytes_per_step"] - d["demand_bytes_per_step"]),
                         "demand_bytes_vs_depth0": round(d["demand_bytes_per_step"] / b["demand_bytes_per_step"] - 1, 4),
                         "bytes_moved_vs_depth0": round(d["bytes_moved_per_step"] / b["bytes_moved_per_step"] - 1, 4),
                         "prefetch_used_share": d["prefetch_used_share"] and round(d["prefetch_used_share"], 4),
                         "same_text_as_depth0": r["texts"] == base["texts"], "cpu_ms_per_step (CPU, one unrepeated run: noise)": round(d["cpu_ms_per_step"], 2)}
    doc = {"question": __doc__.splitlines()[0],
           "command": "PYTHONPATH=. python experiments/lookahead.py --model ../shared/models/qwen3-moe-bytes-6m --out experiments/results/lookahead.json",
           "model": "../shared/models/qwen3-moe-bytes-6m", "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                                                                   "torch_threads": torch.get_num_threads()},
           "setup": {"window": WINDOW, "fit_windows": FIT_WINDOWS, "test_windows": TEST_WINDOWS, "prompts": PROMPTS, "prompt_bytes": PROMPT_BYTES,
                     "new_tokens": NEW_TOKENS, "call_sizes": CALL_SIZES},
           "definitions": {"recall": "share of the experts a layer call used that were predicted (1 token: |pred & used| / k)",
                           "waste": "share of the predicted experts the call did not use", "predicted/used": "experts per call, mean",
                           "popular": "the layer's most popular experts over the fit windows, as many as lookahead_d1 predicted",
                           "demand_bytes": "bytes_moved - prefetch bytes: copied up for misses, which stall", "step": "one decode token",
                           "wasted_bytes": "prefetched experts evicted unused (tiers.stats prefetch.wasted_bytes)",
                           "prefetch_used_share": "prefetch used / issued"},
           "prediction": pred, "tiers_summary": summary, "tiers_arms": arms}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
