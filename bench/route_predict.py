"""How well speculative routing predicts a long prompt's experts: the next layer's router on this layer's input.

    python bench/route_predict.py [--model qwen3_moe] [--layers 6] [--prefill 2048] [--prompts 1] [--out FILE]

Lookahead (``prefetch_depth``) predicts layer i + 1's experts by applying its router to the
hidden states layer i's experts see. For one token that names the next layer's top-k; for a
prompt's prefill the prediction is a set: every expert some token's predicted top-k names. This
builds a random-weight model of real shapes (``tools.measure``; the bench's prompt, seed 1),
runs one prefill with hooks that record each experts call's input and routing, and for each
pair of consecutive layers reports the experts the second used, and the experts predicted at
least ``n`` times (n = 1, 2, 4, ..., 32) with their precision (predicted and used / predicted),
recall (predicted and used / used) and the share of routed rows they cover. With ``--prompts N``
(N >= 2) it runs N - 1 more prompts (random tokens, seeds 2, 3, ...) and reports, per layer and
prompt, how well the experts the prompt before used at that layer predict the ones this prompt
uses (``history``): a predictor that needs no router, if prompts share their experts.

Why: reading a predicted expert ahead saves its read only when it is used, and a wrong one
costs its bytes and a slot. Device-independent (it counts experts, it times nothing); on a
2-core CPU, 6 Qwen3-30B-A3B layers took about 7 GB of memory and a minute.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

import torch  # noqa: E402

THRESHOLDS = (1, 2, 4, 8, 16, 32)


def predict(x: torch.Tensor, router: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per expert, how many of the tokens in ``x`` [T, H] name it among ``router``'s top-k."""
    picks = torch.topk(x.float() @ router.float().t(), top_k, dim=-1).indices
    return torch.bincount(picks.reshape(-1), minlength=router.shape[0])


def score(predicted: torch.Tensor, used: torch.Tensor) -> list[dict]:
    """Precision, recall and covered rows of the experts predicted at least ``n`` times, per threshold."""
    hit = used > 0
    out = []
    for n in THRESHOLDS:
        p = predicted >= n
        both = int((p & hit).sum())
        out.append({"at_least": n, "predicted": int(p.sum()), "precision": both / max(1, int(p.sum())),
                    "recall": both / max(1, int(hit.sum())), "rows_covered": float(used[p].sum() / used.sum())})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=1, help="prompts to run; from 2: how well the last prompt's experts predict the next's")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from tiers.integration import _router_weight
    from tiers.tools.measure import SHAPES, build, expert_modules, write_result

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build(args.model, dict(SHAPES[args.model], layers=args.layers), device)
    mods = expert_modules(model)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [m.register_forward_pre_hook(lambda mod, a, L=L: seen.__setitem__(L, (a[0].detach(), a[1].detach())))
               for L, (_, m) in mods.items()]
    g = torch.Generator().manual_seed(1)  # the bench's prompts: its 16-token decode prompt, then the prefill
    vocab = model.config.vocab_size
    torch.randint(0, vocab, (1, 16), generator=g)
    ids = torch.randint(0, vocab, (1, args.prefill), generator=g).to(device)
    with torch.no_grad():
        model(ids)
    top_k = model.config.num_experts_per_tok
    layers = sorted(seen)

    def rows_per_expert() -> dict[int, torch.Tensor]:
        return {L: torch.bincount(seen[L][1].reshape(-1), minlength=mods[L][1].num_experts)[: mods[L][1].num_experts].cpu() for L in layers}

    pairs = []
    for a, b in zip(layers, layers[1:]):
        name, mod = mods[b]
        router = _router_weight(model, name, mod)
        used = torch.bincount(seen[b][1].reshape(-1), minlength=mod.num_experts)[: mod.num_experts]
        pairs.append({"from": a, "to": b, "used": int((used > 0).sum()), "experts": int(mod.num_experts),
                      "thresholds": score(predict(seen[a][0], router, top_k), used.cpu())})
        row = pairs[-1]
        print(f"layer {a} -> {b}: used {row['used']}/{row['experts']}; "
              + "; ".join(f">={t['at_least']}: {t['predicted']} p {t['precision']:.2f} r {t['recall']:.2f}" for t in row["thresholds"]), flush=True)
    used_by = [rows_per_expert()]  # per prompt: rows per expert at each layer
    for seed in range(2, args.prompts + 1):
        with torch.no_grad():
            model(torch.randint(0, vocab, (1, args.prefill), generator=torch.Generator().manual_seed(seed)).to(device))
        used_by.append(rows_per_expert())
    for h in handles:
        h.remove()
    history = []  # the experts the prompt before used at a layer, as this prompt's prediction there
    for p in range(1, len(used_by)):
        for L in layers:
            before, now = used_by[p - 1][L], used_by[p][L]
            row = {"prompt": p + 1, "layer": L, "used": int((now > 0).sum()), "used_before": int((before > 0).sum())}
            history.append(row | score(before, now)[0])  # predicted: used at least once before
            print(f"prompt {p + 1}, layer {L}: used {row['used']}, the prompt before {row['used_before']}; "
                  f"p {history[-1]['precision']:.2f} r {history[-1]['recall']:.2f} rows {history[-1]['rows_covered']:.2f}", flush=True)
    result = {"command": "python bench/route_predict.py " + " ".join(sys.argv[1:]), "model": args.model,
              "layers": args.layers, "prefill_tokens": args.prefill, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "pairs": pairs, "history": history}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
