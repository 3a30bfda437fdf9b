"""How far the staging-slot cache is from Belady's MIN on the skewed trace, and why.

    python experiments/cache_bound.py [--tokens 256] [--seed 0] [--models mixtral,qwen3_moe] [--splits 9:4,10:4]
                                [--out experiments/results/cache_bound.json]

The bench replays the cache policies against Belady's MIN on synthetic traces (capacity 25% of
the experts, no pinned set). This asks what the remaining gap is made of, on the same traces
(Mixtral's and Qwen3-30B-A3B's expert counts, per-layer Zipf s = 1.2, reuse 0.5, unless ``--zipf`` and
``--reuse`` say otherwise):

- ``oracle``: evicts the slot whose expert is next used farthest away, knowing the trace, but
  like the engine never evicts an expert the current layer call uses. Its distance to Belady is
  what that protection costs; the forecast's distance to it is what prediction costs.
- ``forecast`` and variants of its victim rule, each from the same per-expert moving averages:
  ``min_p`` (the least likely to be used at its layer's next call), ``p_over_d`` (that chance per
  layer call of distance), and the shipped rule with other moving-average rates.
- ``true_p`` and ``true_p_over_d``: the same two rules given the trace model's own per-expert
  chances of use at the next call, apart for an expert its layer used at its last call and one
  it did not (the model is a Markov chain in that state), measured on 8192 later tokens of the
  same model: what prediction from the past could reach on this trace at best with these rules.
- ``learned_p``: those chances counted online from the trace so far (per expert, with a prior).
- ``markov``: the shipped policy of that kind (``tiers.cache.MarkovSlots``): the forecast's
  victim rule with those chances counted online, pulled towards the forecast's averages.

- ``splits`` (``--splits HOT:STAGING,...``): the GPU tier as the engine holds it, a hot set
  pinned and the shipped policy over the staging slots, for each split of slots. Hot counts per
  layer are round-robin over layers, as loaded, and each layer's hot experts are its most popular
  under the trace model (where the rebalancer takes them); the hit rate of hot and staging
  together, Belady's over as many slots with none pinned, and their ratio. What the split of a
  budget between hot and staging slots is worth, with Mixtral-8x7B's counts: at 25% of its
  experts a staging slot and its transit row cost 1.5 hot slots, two transit rows 1.
- ``online_bound_over_belady``: the most hits any online policy can expect on the trace
  (``online_bound``: the cache must hold, before a token's first layer call, every expert that
  will hit in that token, chosen before its layer's draw), over Belady's. Where it is below 0.95,
  no policy of this cache reaches 0.95x Belady but by chance.

Device-independent: replays count hits, they time nothing.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402

from tiers.loader.layout import ExpertKey  # noqa: E402
from tiers.cache import ForecastSlots, LruSlots, MarkovSlots, belady_hits, replay  # noqa: E402
from tiers.trace import TraceModel, lookups  # noqa: E402
from tiers.tools.measure import write_result  # noqa: E402

COUNTS = {"mixtral": (8, 8, 2), "qwen3_moe": (12, 128, 8)}  # layers, experts, top-k


class OracleSlots(ForecastSlots):
    """Knows each lookup's next use; protects the current call's experts as the engine does."""

    def __init__(self, slots, layers, next_use: list[int]):
        super().__init__(slots, layers)
        self.next_use, self.at, self.due = next_use, 0, {}

    def access(self, key) -> None:
        super().access(key)
        self.due[key] = self.next_use[self.at]
        self.at += 1

    def _choose(self, readers) -> int | None:
        free = [s for s in self._order if readers[s] == 0]
        return max(free, key=lambda s: -1 if self._owner[s] in self.in_call else self.due.get(self._owner[s], 0), default=None)


class RuleSlots(ForecastSlots):
    """The forecast's moving averages with another victim rule."""

    def __init__(self, slots, layers, rule: str):
        super().__init__(slots, layers)
        self.rule = rule

    def _choose(self, readers) -> int | None:
        free = [s for s in self._order if readers[s] == 0]
        n = max(len(self.position), 1)

        def score(s: int) -> float:  # larger: evicted first
            key = self._owner[s]
            if key in self.in_call:
                return float("-inf")
            p = max(*self._averages(key), 1e-6)
            if self.rule == "min_p":
                return -p
            here, there = self.position.get(self.current), self.position.get(key.layer)
            d = n if here is None or there is None else ((there - here) % n or n)
            return -p / d

        return max(free, key=score, default=None)


class TransitionSlots(ForecastSlots):
    """Evict the least likely to be used at its layer's next call (``over_d``: per layer call of
    distance), that chance given apart for experts the layer used at its last call (``a``) and the
    rest (``b``): fixed tables ``[layer][expert]``, or (None) counted online, with priors."""

    def __init__(self, slots, layers, experts: int, a=None, b=None, over_d: bool = False):
        super().__init__(slots, layers)
        self.experts, self.table, self.over_d = experts, (a, b), over_d
        self.prev: dict[int, set] = {}  # layer -> experts of its last call
        self.seen: dict[int, int] = {}  # layer -> transitions counted
        self.na, self.ha, self.hb = Counter(), Counter(), Counter()  # (layer, expert) -> counts
        self.kept, self.kept_of = Counter(), Counter()  # layer -> reuses, chances to reuse

    def visit(self, layer, keys=()) -> None:
        keys = list(keys)
        cur, prev = {k.expert for k in keys}, self.prev.get(layer)
        if prev is not None:
            self.seen[layer] = self.seen.get(layer, 0) + 1
            for x in prev:
                self.na[(layer, x)] += 1
                self.kept_of[layer] += 1
                if x in cur:
                    self.ha[(layer, x)] += 1
                    self.kept[layer] += 1
            for x in cur - prev:
                self.hb[(layer, x)] += 1
        self.prev[layer] = cur
        super().visit(layer, keys)

    def chance(self, key) -> float:
        layer, x = key
        used = x in self.prev.get(layer, ())
        a, b = self.table
        if a is not None:
            return (a if used else b)[self.position[layer]][x]
        if used:  # few samples per expert: pull towards the layer's reuse rate
            reuse = (self.kept[layer] + 1) / (self.kept_of[layer] + 2)
            return (self.ha[(layer, x)] + 4 * reuse) / (self.na[(layer, x)] + 4)
        k = len(self.prev.get(layer, ())) or 1
        return (self.hb[(layer, x)] + 2 * k / self.experts) / (self.seen.get(layer, 0) - self.na[(layer, x)] + 2)

    def _choose(self, readers) -> int | None:
        n, here = len(self.position), self.position[self.current]

        def score(s: int) -> float:  # larger: evicted first
            key = self._owner[s]
            if key in self.in_call:
                return float("-inf")
            p = self.chance(key)
            return -p / (((self.position[key.layer] - here) % n) or n) if self.over_d else -p

        return max((s for s in self._order if readers[s] == 0), key=score, default=None)


def transition_tables(model: TraceModel, tokens: int) -> tuple[list, list]:
    """Per layer and expert: P(used at the next call | used at this one), and | not used, from
    ``tokens`` tokens sampled after the ones replayed (the chain is stationary there)."""
    trace = model.sample(tokens)[-(tokens // 2):]  # [T, L, k], the later half
    used = torch.zeros(trace.shape[0], model.num_layers, model.num_experts, dtype=torch.bool).scatter_(2, trace, True)
    prev, nxt = used[:-1], used[1:]
    a = (prev & nxt).sum(0).double() / prev.sum(0).clamp_min(1).double()
    b = (~prev & nxt).sum(0).double() / (~prev).sum(0).clamp_min(1).double()
    return a.tolist(), b.tolist()


def next_call_chances(model: TraceModel, layer: int, prev: list[int], draws: int, g: torch.Generator,
                      chunk: int = 1024) -> torch.Tensor:
    """[experts]: each expert's chance of being used at ``layer``'s next call, given that its last
    call used ``prev``, estimated from ``draws`` draws of that call by the model's own rule
    (``chunk`` at a time)."""
    k, r, n = model.top_k, model.reuse_p, model.num_experts
    log_pop = model.popularity()[layer].log()  # [E]
    counts = torch.zeros(n, dtype=torch.float64)
    for start in range(0, draws, chunk):
        d = min(chunk, draws - start)
        prev_t = torch.tensor(prev, dtype=torch.long).expand(d, k)  # [d, k]
        kept = torch.rand(d, k, generator=g) < r  # [d, k]
        u = torch.rand(d, n, dtype=torch.float64, generator=g)
        masks = torch.zeros(d, k, dtype=torch.float64).masked_fill_(kept, float("-inf"))
        keys = (log_pop - u.log_().neg_().log_()).scatter_add_(1, prev_t, masks)  # a kept expert is not drawn again
        fresh = keys.topk(k, dim=1).indices  # [d, k] in draw order
        need = k - kept.sum(1, keepdim=True)  # [d, 1]
        used = torch.zeros(d, n, dtype=torch.bool)
        used.scatter_(1, prev_t, kept)
        used.scatter_(1, fresh, torch.arange(k) < need)
        counts += used.sum(0)
    return counts / draws


def online_bound(model: TraceModel, trace: torch.Tensor, capacity: int, draws: int = 4000, seed: int = 0) -> float:
    """The most hits per lookup any online policy can expect on ``trace`` (``[T, L, k]``, distinct
    picks) with ``capacity`` slots, no pinned set and nothing loaded ahead.

    An expert of layer ``l`` enters the cache only at a miss in ``l``'s call, so one in the cache
    at ``l``'s call of token ``t`` sat there since ``l``'s call of token ``t - 1``; just before the
    first layer's call of token ``t``, the cache therefore holds every expert that will hit at
    token ``t``, at most ``capacity`` of them, chosen before their calls' draws. Each layer's chain
    is independent of the others, and its next call's distribution is set by its last call, so a
    policy's expected hits at token ``t`` are at most the sum of the ``capacity`` largest chances
    over all layers (token 0: none; the cache starts empty). Chances are Monte Carlo estimates
    (``draws`` per distinct state), which can only raise the sum's expectation."""
    g = torch.Generator().manual_seed(seed)
    memo: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    hits = 0.0
    for t in range(1, trace.shape[0]):
        chances = []
        for layer in range(trace.shape[1]):
            state = (layer, tuple(sorted(trace[t - 1, layer].tolist())))
            if state not in memo:
                memo[state] = next_call_chances(model, layer, list(state[1]), draws, g)
            chances.append(memo[state])
        allp = torch.cat(chances)
        hits += allp.topk(min(capacity, allp.numel())).values.sum().item()
    return hits / trace.numel()


def next_uses(seq: list) -> list[int]:
    out, last = [len(seq)] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        out[i] = last.get(seq[i], len(seq))
        last[seq[i]] = i
    return out


def measure(model: str, tokens: int = 256, seed: int = 0, draws: int = 4000, only: list[str] | None = None, bound: bool = True,
            zipf: float = 1.2, reuse: float = 0.5) -> dict:
    """One model's counts: Belady, each policy (``only``: these alone) over Belady, and the online bound."""
    layers_n, experts, k = COUNTS[model]
    layers = list(range(layers_n))
    trace_model = TraceModel(layers_n, experts, k, zipf_s=zipf, reuse_p=reuse, seed=seed)
    trace = trace_model.sample(tokens)
    seq = lookups(trace, layers)
    tables: list = []  # the true chances, sampled only if a rule given them is replayed

    def true_chances() -> tuple[list, list]:
        if not tables:
            tables.extend(transition_tables(trace_model, 16384))
        return tables[0], tables[1]
    cap = max(1, int(0.25 * layers_n * experts))
    belady = belady_hits(seq, cap, set())
    policies = {
        "oracle": lambda s: OracleSlots(s, layers, next_uses(seq)),
        "lru": LruSlots,
        "forecast": lambda s: ForecastSlots(s, layers),
        "markov": lambda s: MarkovSlots(s, layers, experts=experts),
        "min_p": lambda s: RuleSlots(s, layers, "min_p"),
        "p_over_d": lambda s: RuleSlots(s, layers, "p_over_d"),
        "true_p": lambda s: TransitionSlots(s, layers, experts, *true_chances()),
        "true_p_over_d": lambda s: TransitionSlots(s, layers, experts, *true_chances(), over_d=True),
        "learned_p": lambda s: TransitionSlots(s, layers, experts),
    }
    for fast, slow in ((0.5, 0.02), (0.7, 0.02), (0.9, 0.01), (0.9, 0.05)):
        policies[f"forecast_fast{fast}_slow{slow}"] = lambda s, f=fast, w=slow: ForecastSlots(s, layers, fast=f, slow=w)
    row = {"counts": {"layers": layers_n, "experts": experts, "top_k": k}, "capacity": cap, "lookups": len(seq),
           "belady_hit_rate": belady / len(seq)}
    unknown = set(only or ()) - set(policies)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {sorted(policies)}")
    row["over_belady"] = {name: replay(seq, cap, set(), make) / belady for name, make in policies.items() if only is None or name in only}
    # the most any online policy can expect here, against what Belady got on this draw of the trace
    if bound:
        row["online_bound_over_belady"] = online_bound(trace_model, trace, cap, draws=draws) * len(seq) / belady
    return row


def parse_splits(text: str) -> list[tuple[int, int]]:
    """``HOT:STAGING,...`` as (hot, staging) pairs of counts, staging at least 1; refuses anything else."""
    out = []
    for item in text.split(","):
        try:
            hot, staging = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--splits: {item!r} is not HOT:STAGING (two integers)") from None
        if hot < 0 or staging < 1:
            raise SystemExit(f"--splits: {item!r} needs HOT >= 0 and STAGING >= 1")
        out.append((hot, staging))
    return out


def hot_set(model: TraceModel, hot: int) -> set:
    """``hot`` experts: per-layer counts round-robin over layers (as a load places them), each
    layer's most popular under ``model`` (where the rebalancer takes them)."""
    pop = model.popularity()
    per_layer = [hot // model.num_layers + (layer < hot % model.num_layers) for layer in range(model.num_layers)]
    return {ExpertKey(layer, int(e)) for layer, n in enumerate(per_layer) for e in pop[layer].argsort(descending=True)[:n].tolist()}


def measure_splits(model: str, splits: list[tuple[int, int]], tokens: int, seed: int = 0, zipf: float = 1.2, reuse: float = 0.5) -> list[dict]:
    """Per split: the shipped policy over the staging slots behind a pinned hot set, against
    Belady's over as many slots (``splits`` in the module docstring)."""
    layers_n, experts, k = COUNTS[model]
    layers = list(range(layers_n))
    trace_model = TraceModel(layers_n, experts, k, zipf_s=zipf, reuse_p=reuse, seed=seed)
    seq = lookups(trace_model.sample(tokens), layers)
    rows = []
    for hot_n, staging in splits:
        if hot_n > layers_n * experts:
            raise SystemExit(f"--splits: {hot_n} hot experts, but {model} has {layers_n * experts}")
        hot = hot_set(trace_model, hot_n)
        hits = sum(key in hot for key in seq) + replay(seq, staging, hot, lambda s: MarkovSlots(s, layers, experts=experts))
        belady = belady_hits(seq, hot_n + staging, set())
        rows.append({"hot": hot_n, "staging": staging, "hit_rate": hits / len(seq), "belady_hit_rate": belady / len(seq),
                     "over_belady": hits / belady})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--draws", type=int, default=4000, help="Monte Carlo draws per layer state for the online bound")
    ap.add_argument("--seed", type=int, default=0, help="the trace model's seed")
    ap.add_argument("--models", default=",".join(COUNTS), help="comma-separated: which models' counts")
    ap.add_argument("--no-bound", action="store_true", help="skip the online bound (its Monte Carlo dominates long traces)")
    ap.add_argument("--policies", default=None, help="comma-separated: replay only these policies (default: all)")
    ap.add_argument("--zipf", type=float, default=1.2, help="the trace's per-layer Zipf exponent (0: uniform)")
    ap.add_argument("--reuse", type=float, default=0.5, help="the trace's chance a token keeps an expert of the last one")
    ap.add_argument("--splits", default=None, metavar="HOT:STAGING,...",
                    help="also replay the GPU tier as hot and staging slots, for each split (see the docstring)")
    ap.add_argument("--out", default="experiments/results/cache_bound.json")
    args = ap.parse_args(argv)
    splits = parse_splits(args.splits) if args.splits else None
    result = {"command": "python experiments/cache_bound.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "trace": {"zipf_s": args.zipf, "reuse_p": args.reuse, "seed": args.seed, "tokens": args.tokens},
              "models": {m: measure(m, args.tokens, seed=args.seed, draws=args.draws, only=args.policies and args.policies.split(","),
                                    bound=not args.no_bound, zipf=args.zipf, reuse=args.reuse) for m in args.models.split(",")}}
    if splits:
        for m, row in result["models"].items():
            row["splits"] = measure_splits(m, splits, args.tokens, seed=args.seed, zipf=args.zipf, reuse=args.reuse)
    write_result(args.out, result)
    for m, row in result["models"].items():
        print(m, f"belady {row['belady_hit_rate']:.3f}", " ".join(f"{k} {v:.3f}" for k, v in row["over_belady"].items()),
              f"online bound {row['online_bound_over_belady']:.3f}" if "online_bound_over_belady" in row else "")
        for r in row.get("splits", ()):
            print(f"  {r['hot']} hot + {r['staging']} staging: hit rate {r['hit_rate']:.3f}, belady {r['belady_hit_rate']:.3f}, "
                  f"over belady {r['over_belady']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
