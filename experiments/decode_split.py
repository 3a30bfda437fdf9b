"""Where a decode token's time goes, without a profiler: host time against device time.

    python experiments/decode_split.py [--model qwen3_moe] [--layers 6] [--tokens 16]
                                 [--arms all_gpu,tiers_100_bf16,tiers_50_int8,tiers_50_int8-nodirect] --out FILE

A profiler slows the host two-fold, which moves a decode step from one regime to another (the
GPU waiting on Python, or Python waiting on the GPU), so this measures with clocks alone. Hooks
on the decoder layers and their experts modules record ``time.perf_counter`` (host) and a CUDA
timing event (device) at each layer's start and each experts call's start and end. Per arm and
decode token:

- ``token_ms``: host time from one token's first layer to the next token's (what decode costs);
- ``host_forward_ms``: host time from a token's first layer to its last layer's end (launching);
- ``host_experts_ms``: host time inside the experts calls; ``device_experts_ms`` the same span
  on the device clock, whose excess over the host's is what the device added;
- ``host_before_experts_ms``, ``host_after_experts_ms``: host time in the layers before and
  after their experts calls (attention, norms, router);
- ``device_token_ms``: the device's time between two tokens' first layers;
- ``host_<step>_ms``: host time per token in the engine's direct decode steps (``direct_ready``,
  ``fetch_direct``) and, within ``fetch_direct``, in the kernel launch (``launch``).

When ``host_forward_ms`` is close to ``token_ms`` the host bounds decode and a faster GPU path
would not show; otherwise the device does. Arms are as in ``bench/profile_arms.py`` (a probe since deleted, in git history);
``-nodirect`` turns direct reads (and so direct decode) off; ``@skewed`` routes by the bench's
skewed trace, with the rebalancer on (every ``--rebalance-every`` tokens; its serving-thread
steps are timed as ``host_rebalancer.<step>_ms``, ``host_take_direct_usage_ms`` and
``host__refresh_direct_ms``), ``@skewed_norebal`` with it off; ``+h2d`` (an all-GPU arm) keeps the
PCIe link busy with large pinned host-to-device copies on a side stream while it is measured,
which asks whether traffic on the link alone slows the host's launches.

Variants, to find where an arm's host time goes (each ``~name`` before the ``@``, any number):

- ``~idle``: the rebalancer counts but never closes an interval (no plan, no move, no read);
- ``~inline``: no reader threads (``tiers.nvme.reader_threads: 0``): the rebalancer reads on the
  serving thread;
- ``~gcoff``: Python's garbage collector off while the arm is timed;
- ``~switch``: the interpreter's thread switch interval at 50 us (5 ms by default) while timed,
  which shortens how long the serving thread can wait for the GIL behind another thread.
- ``~nograph``: decode graphs off (``tiers.gpu.decode_graphs: false``): every experts call
  launches its kernels one by one from Python.
- ``~largedirect``: direct decode for experts of any size (``DirectDecoder.DECODE_BYTES`` unbounded,
  as it is by default now; it was 32 MiB in transfer form when this variant was added).
- ``~hostlarge``: the former bound: experts above 32 MiB in transfer form (Mixtral-8x7B's) keep
  the host-routed path in decode.
- ``~omp1``: torch's intra-op threads at 1 for the arm, from before it loads (its reader and
  rebalance threads then run their host copies on one thread each, not on a team of OpenMP
  threads per calling thread, whose workers spin for a while after each copy).
- ``~alwaysdirect``: every decode stage direct (``DirectDecoder.DIRECT_MISS_BYTES`` unbounded: no
  stage gives way to the host-routed path however many bytes its calls miss).

``--rebalance-warmup N``: ``@skewed`` arms with the rebalancer generate N more tokens before
timing (as ``tools/bench.py``), so the timed tokens see a settled hot set.

``token_ms_all`` lists every timed token's host time, rep by rep, so work done every few tokens
shows where it falls. ``--cprofile N`` also runs one generate under cProfile per arm and keeps
the N functions with the most own time (ms per decode token, calls per decode token).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from tiers.tools.measure import Steps  # noqa: E402


class Clock:
    """Host and device timestamps at named points of each forward."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, int, float, object]] = []
        self.on = False

    def mark(self, what: str, layer: int) -> None:
        if not self.on:
            return
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.marks.append((what, layer, time.perf_counter(), ev))

    def attach(self, model) -> list:
        handles = []
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self.mark("layer", i)))
            handles.append(layer.register_forward_hook(lambda m, a, o, i=i: self.mark("layer_end", i)))
            experts = layer.mlp.experts
            handles.append(experts.register_forward_pre_hook(lambda m, a, i=i: self.mark("experts", i)))
            handles.append(experts.register_forward_hook(lambda m, a, o, i=i: self.mark("experts_end", i)))
        return handles

    def split(self, n_layers: int) -> dict:
        """Per-token medians over the tokens after the first (the prompt's forward)."""
        if self.cuda:
            torch.cuda.synchronize()
        starts = [i for i, (w, L, _, _) in enumerate(self.marks) if w == "layer" and L == 0]

        def dev(a, b) -> float:
            return a[3].elapsed_time(b[3]) if self.cuda else float("nan")

        rows = []
        for t, (s, nxt) in enumerate(zip(starts, starts[1:])):
            if t == 0:
                continue  # the prompt's forward
            span = self.marks[s:nxt]
            last_end = max(i for i, m in enumerate(span) if m[0] == "layer_end" and m[1] == n_layers - 1)
            host_exp = dev_exp = host_pre = host_post = 0.0
            for a, b in zip(span, span[1:]):
                if a[0] == "experts" and b[0] == "experts_end":
                    host_exp += (b[2] - a[2]) * 1e3
                    dev_exp += dev(a, b)
                elif a[0] == "layer" and b[0] == "experts":
                    host_pre += (b[2] - a[2]) * 1e3
                elif a[0] == "experts_end" and b[0] == "layer_end":
                    host_post += (b[2] - a[2]) * 1e3
            rows.append({"token_ms": (self.marks[nxt][2] - span[0][2]) * 1e3,
                         "host_forward_ms": (span[last_end][2] - span[0][2]) * 1e3,
                         "host_experts_ms": host_exp, "device_experts_ms": dev_exp,
                         "host_before_experts_ms": host_pre, "host_after_experts_ms": host_post,
                         "device_token_ms": dev(span[0], self.marks[nxt])})
        # medians, and the mean token: work done every few tokens (a rebalance) shows in the mean only
        return ({k: statistics.median(r[k] for r in rows) for k in rows[0]}
                | {"token_ms_mean": statistics.mean(r["token_ms"] for r in rows), "tokens": len(rows),
                   "token_ms_all": [round(r["token_ms"], 3) for r in rows]})


VARIANTS = ("idle", "inline", "gcoff", "switch", "nograph", "largedirect", "hostlarge", "alwaysdirect", "omp1")


@contextlib.contextmanager
def timed_conditions(variants: set[str]):
    """The interpreter's state an arm is timed under: its collector and thread switch interval."""
    was_gc, was_switch = gc.isenabled(), sys.getswitchinterval()
    if "gcoff" in variants:
        gc.disable()
    if "switch" in variants:
        sys.setswitchinterval(5e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(was_switch)
        if was_gc:
            gc.enable()


def top_functions(prof: cProfile.Profile, n: int, per: int) -> list[dict]:
    """The ``n`` functions with the most own time, per ``per`` tokens."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [{"function": f"{os.path.basename(f)}:{line}({name})", "own_ms": round(own * 1e3 / per, 4),
             "cum_ms": round(cum * 1e3 / per, 4), "calls": round(calls / per, 2)}
            for (f, line, name), (_, calls, own, cum, _) in rows]


def parse_arm(name: str) -> tuple[int, str, bool, frozenset[str], str | None]:
    """``tiers_<pct>_<precision>[-nodirect][~variant ...][@skewed[_norebal]]`` -> its parts."""
    arm = re.fullmatch(r"tiers_(\d+)_(\w+?)(-nodirect)?((?:~[a-z0-9]+)*)(@skewed(?:_norebal)?)?", name)
    if arm is None:
        raise SystemExit(f"--arms: cannot read {name!r} (expected tiers_<pct>_<precision>[-nodirect][~variant ...][@skewed[_norebal]])")
    pct, precision, nodirect, variants, skewed = arm.groups()
    names = frozenset(v for v in variants.split("~") if v)
    unknown = sorted(names - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--arms: {name!r} has unknown variant(s) {unknown} (known: {', '.join(VARIANTS)})")
    if "idle" in names and skewed != "@skewed":
        raise SystemExit(f"--arms: {name!r}: ~idle idles the rebalancer, which only @skewed arms run")
    return int(pct), precision, bool(nodirect), names, skewed


def _measure(ctx, name, m, variants=frozenset()) -> None:
    """Time one arm (routed by the skewed trace for an ``@skewed`` arm) into ``ctx.result``."""
    from tiers.tools.routing import TraceRouting

    if "@skewed" in name:  # as tools/bench.py routes its skewed arms
        with TraceRouting(m, tokens=4096):
            return _measured(ctx, name, m, variants)
    return _measured(ctx, name, m, variants)


def _measured(ctx, name, m, variants) -> None:
    """One arm's decode ms per token, its per-step split on the host and the device, and its profile."""
    from tiers.integration import manager_of
    from tiers.tools.bench_tiers import rebalance_warmup_generates
    from tiers.tools.measure import decode_ms_per_token

    args, prompt, device, result = ctx.args, ctx.prompt, ctx.device, ctx.result
    kw = dict(do_sample=False, pad_token_id=0)
    m.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    if name.endswith("@skewed") and not name.startswith("all_gpu"):  # the rebalancer's own warm-up
        for n in rebalance_warmup_generates(args.rebalance_warmup):
            m.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
    with timed_conditions(variants):
        row = {"decode_ms_per_token": statistics.median(decode_ms_per_token(m, prompt, args.tokens, device, 1) for _ in range(args.reps))}
    clock = Clock(device)
    handles = clock.attach(m)
    splits = []
    steps = Steps()
    if not name.startswith("all_gpu"):
        from tiers.quant import direct

        mgr = manager_of(m)
        for attr in ("direct_ready", "fetch_direct"):
            steps.wrap(mgr, attr, attr)
        steps.wrap(direct, "fetch", "launch")
        if mgr.rebalancer is not None:  # its serving-thread steps (the reads run on its own threads)
            for attr in ("take_direct_usage", "_refresh_direct"):
                steps.wrap(mgr, attr, attr)
            for attr in ("note_call", "land", "rebalance", "_issue", "_finish_hot"):
                steps.wrap(mgr.rebalancer, attr, "rebalancer." + attr)
    load = name.endswith("+h2d") and device.type == "cuda"
    if load:
        src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        side = torch.cuda.Stream(device)
    for _ in range(args.reps):
        if load:  # ~55 GB/s for as long as the generate takes (bounded by 48 copies, 12 GiB)
            with torch.cuda.stream(side):
                for _ in range(48):
                    dst.copy_(src, non_blocking=True)
        clock.marks, clock.on = [], True
        with timed_conditions(variants):
            m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)
        clock.on = False
        splits.append(clock.split(args.layers))
        if load:
            side.synchronize()
    steps.restore()
    for h in handles:
        h.remove()
    row |= {k: statistics.median(s[k] for s in splits) for k in splits[0] if k != "token_ms_all"}
    row["token_ms_all"] = [s["token_ms_all"] for s in splits]
    if args.cprofile:  # the prompt's forward is in it too; per decode token regardless
        prof = cProfile.Profile()
        with timed_conditions(variants):
            prof.enable()
            m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)
            prof.disable()
        row["cprofile_top"] = top_functions(prof, args.cprofile, args.tokens - 1)
    # per decode token (the prompt's forward runs none of these: direct decode is decode only)
    row |= {f"host_{k}_ms": v / (args.reps * (args.tokens - 1)) for k, v in steps.ms.items()}
    if name.startswith("tiers_"):
        mgr = manager_of(m)  # which path the last stage took, and the mean it chose the next by
        row["host_routed_pools"] = len(mgr.host_routed_pools)
        row["decode_miss_mib_per_call"] = {str(i): b / 2**20 for i, b in enumerate(mgr.decode_miss_bytes.values())}
    result["arms"][name] = row
    print(name, json.dumps({k: round(v, 3) for k, v in row.items() if isinstance(v, float)}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arms", default="all_gpu,tiers_100_bf16,tiers_50_int8,tiers_50_int8-nodirect")
    ap.add_argument("--rebalance-every", type=int, default=8, help="@skewed arms: rebalance every this many tokens (as tools/bench.py)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="also profile one generate per arm with cProfile; keep the top N functions by own time")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rebalance-warmup", type=int, default=0, help="@skewed arms with the rebalancer: tokens generated before timing (as tools/bench.py)")
    args = ap.parse_args()

    import tiers
    from tiers.engine import TierManager
    from tiers.integration import manager_of
    from tiers.tools.measure import build_packed, expert_bytes_of, scratch_dir, shape_of, write_result

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = scratch_dir("tiers-split-")
    model, packed = build_packed(args.model, args.layers, device, work)
    shape = shape_of(args.model, args.layers, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=g).to(device)
    arms = args.arms.split(",")
    result = {"command": "python experiments/decode_split.py " + " ".join(sys.argv[1:]), "model": args.model, "shape": shape,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "arms": {},
              # the host the serving thread shares with the arm's other threads
              "host": {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                       "intra_op_threads": torch.get_num_threads(), "parallel_info": torch.__config__.parallel_info().splitlines()}}

    ctx = SimpleNamespace(args=args, prompt=prompt, device=device, result=result)

    def measure(name, m, variants=frozenset()) -> None:
        _measure(ctx, name, m, variants)

    for name in arms:
        if name.startswith("tiers_"):
            parse_arm(name)  # a bad arm is refused before anything is timed
    expert_bytes = expert_bytes_of(model)
    for name in [a for a in arms if a.startswith("all_gpu")]:
        measure(name, model)
    del model
    for name in [a for a in arms if a.startswith("tiers_")]:
        pct, precision, nodirect, variants, skewed = parse_arm(name)
        every = args.rebalance_every if skewed == "@skewed" else 0
        nvme = {"precision": precision} | ({"reader_threads": 0} if "inline" in variants else {})
        cfg = {"tiers": {"gpu": {"fraction": pct / 100, "decode_graphs": "nograph" not in variants},
                         "cpu": {"budget": expert_bytes, "precision": precision, "direct_reads": not nodirect},
                         "nvme": nvme,
                         "rebalance": {"every_tokens": (1 << 30) if every and "idle" in variants else every}}}
        bound, miss_bound = TierManager.DECODE_BYTES, TierManager.DIRECT_MISS_BYTES
        if "alwaysdirect" in variants:
            TierManager.DIRECT_MISS_BYTES = float("inf")
        if "largedirect" in variants:
            TierManager.DECODE_BYTES = None  # read when the first decode stage builds the direct tables
        if "hostlarge" in variants:
            TierManager.DECODE_BYTES = 32 << 20
        threads = torch.get_num_threads()
        if "omp1" in variants:
            torch.set_num_threads(1)
        try:
            m = tiers.load(packed, cfg, device=device, progress=False)
            measure(name, m, variants)
        finally:
            TierManager.DECODE_BYTES, TierManager.DIRECT_MISS_BYTES = bound, miss_bound
            torch.set_num_threads(threads)
        manager_of(m).close()
        del m
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
