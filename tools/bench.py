"""tiers-bench: decode and prefill with offloaded experts, against all-GPU, naive lazy .to() and accelerate.

    python tools/bench.py [--model mixtral|qwen3_moe] [--layers N] [--tokens 32] [--prefill 2048]
                          [--arms all] [--out bench/results] [--device cuda] [--tiny]

Builds a random-weight model of real shapes (Mixtral-8x7B with 8 layers, or Qwen3-30B-A3B with 12
layers, by default), saves and packs it, then measures each arm in one run:

- ``all_gpu``: every expert on the GPU, transformers' default experts implementation;
- ``lazy``: experts in pageable CPU memory, each hit expert moved with ``.to()`` when used;
- ``accelerate``: ``accelerate.dispatch_model`` with the experts modules on "cpu";
- ``tiers_<gpu%>_<cpu precision>``: Tiers at a GPU budget of 100%, 50% and 25% of expert bytes,
  the rest warm in pinned RAM (INT8 or bf16); ``tiers_0_<precision>`` holds only the staging
  slots, the same GPU budget for experts as the lazy and accelerate arms; ``tiers_100_*`` is
  timed over at least ``STATIC_ARM_REPS`` repetitions, since it differs from all-GPU by less than
  the host's drift across two; ``tiers_<gpu%>_<precision>+host``: the same with
  ``tiers.cpu.compute`` on (decode's warm misses split between the copy engine and the host's
  cores; not in ``all``);
- ``<arm>@skewed``: the same arm routed by a skewed, sticky trace (``tools.routing``), with the
  rebalancer on for Tiers; ``<tiers arm>@skewed_norebal``: the same routing, rebalancer off;
  ``<tiers arm>@skewed_routed``: the rebalancer on, loaded with the routing its ``@skewed`` arm
  counted (``tiers.load(..., routing=)``; that arm must come earlier in ``--arms``) and timed
  without the rebalancer's warm-up: what a routing file saves a new process.

Per arm: decode ms/token and tok/s at batch 1 (Tiers arms also against an all-GPU measurement of
the same routing, its repetitions interleaved with theirs; each repetition's pair of decodes is in
the JSON too; and ``--interleave`` decode steps of the arm and that model taking turns, each step
timed alone, ``tools.measure.interleaved_decode``), prefill time, bytes moved per token per source
tier, achieved H2D GB/s, GPU hit rate, peak GPU memory, and the bound
``all-GPU ms/token + moved bytes / 55 GB/s``. The cache policy's hit rate is replayed against
Belady's MIN on the recorded routing trace and on a skewed, sticky synthetic trace
(``tiers.trace.TraceModel``). The offload table holds each offloaded Tiers arm's largest decode
overhead over its statistics against accelerate's and naive lazy's (``offload_overheads``).
Writes ``bench-<model>.json`` and ``.md`` under ``--out``; ``--report FILE.json`` runs nothing and
writes that JSON's Markdown again, its figures derived by this version.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

H2D_BYTES_PER_S = 55e9  # measured pinned host-to-device ceiling on the H200 test machine
# Tiers at 100% runs the all-GPU model's kernels; against its paired all-GPU model it measured
# 1.11x, 0.94x and 1.20x over two repetitions and 1.00x over fifteen (bench-qwen3_moe-run21-t100.md).
STATIC_ARM_REPS = 9
# Timed prefills per Tiers arm, at least: a prefill costs a fraction of a decode repetition, and with
# one (--reps 2) a slow phase of the host decided the ratio (Mixtral's run 35: its three 25% INT8
# arms at 1.22-1.33x against 1.05-1.06x in run 34, with the same bytes and graph counts).
PREFILL_REPS_MIN = 3

TIERS_ARMS = [(1.0, "bf16"), (0.5, "int8"), (0.25, "int8"), (0.5, "bf16"), (0.25, "bf16")]
HOST_SUFFIX = "+host"  # tiers_<p>_<precision>+host: the same arm with tiers.cpu.compute on

from tiers.cache import POLICIES  # noqa: E402
from tiers.config import TiersConfig  # noqa: E402
from tiers.tools.measure import (  # noqa: E402
    INTERLEAVE_SKIP, SHAPES, TINY, block_means, build, copy_sweep, decode_ms_per_token, expert_modules, interleaved_decode,
    lazy_experts_forward, prefill_seconds, sync, write_result,
)
from tiers.tools.timeline import marked_prefill, rebalancer_change, rebalancer_counts  # noqa: E402


def run(args) -> dict:
    import tiers
    from tiers.loader.pack import pack
    from tiers.loader.packed import read_manifest
    from tiers.cache import belady_hits, make_cache, replay
    from tiers.engine import TierManager
    from tiers.integration import manager_of
    from tiers.trace import TraceModel, lookups
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = TINY if args.tiny else SHAPES
    shape = dict(shapes[args.model])
    if args.layers:
        shape["layers"] = args.layers
    arms = args.arms.split(",") if args.arms != "all" else (
        ["all_gpu", "lazy", "accelerate"] + [f"tiers_{int(f * 100)}_{p}" for f, p in TIERS_ARMS]
        + [f"{a}@skewed" for a in ("all_gpu", "tiers_25_int8", "tiers_50_int8")] + ["tiers_25_int8@skewed_norebal"])
    if device.type != "cuda" and "accelerate" in arms:
        arms.remove("accelerate")  # its CPU offload hooks need a separate execution device
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tiers-bench-"))
    src, packed = work / "hf", work / "packed"
    reps = args.reps
    g = torch.Generator().manual_seed(1)
    result: dict = {"command": "python tools/bench.py " + " ".join(args.argv), "model": args.model, "shape": shape,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "decode_tokens": args.tokens, "prefill_tokens": args.prefill, "arms": {},
                    "direct_decode_bytes": TierManager.DECODE_BYTES}
    bar = tqdm(total=len(arms) + 2, desc="bench", unit="step")
    skew = dict(zipf_s=args.zipf, reuse_p=args.reuse, seed=0)
    result["routing"] = {"uniform": "the random-weight routers", "skewed": {**skew, "model": "tiers.trace.TraceModel via tools.routing.TraceRouting"}}

    def routed(m, name):
        """Route ``m`` by the skewed trace for an arm named ``...@skewed...``; a no-op context otherwise."""
        from tiers.tools.routing import TraceRouting

        return TraceRouting(m, **skew, tokens=max(4096, 2 * args.prefill)) if "@skewed" in name else contextlib.nullcontext()

    model = build(args.model, shape, device)
    vocab = model.config.vocab_size
    top_k = model.config.num_experts_per_tok
    prompt = torch.randint(0, vocab, (1, 16), generator=g).to(device)
    prefill_ids = torch.randint(0, vocab, (1, args.prefill), generator=g).to(device)
    mods = expert_modules(model)
    expert_bytes = sum(p.numel() * p.element_size() for _, m in mods.values() for n, p in m.named_parameters(recurse=False) if p.dim() >= 3)
    result["expert_bytes_bf16"] = expert_bytes
    result["experts"] = sum(m.num_experts for _, m in mods.values())

    if args.attention_warmup:
        result["attention_warmup"] = warm_attention(model, prompt, attention_warmup_tokens(args), device)

    def save_partial():
        if args.out:
            write_result(Path(args.out) / f"bench-{args.model}.partial.json", result)

    def failed(name, e):
        result["arms"][name] = {"error": f"{type(e).__name__}: {e}"}
        bar.update(1)
        save_partial()

    def measure(name, m, extra=None, slow=False):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tokens, r = (args.slow_tokens, 1) if slow else (args.tokens, reps)
        if not slow:  # the same warm-up as the Tiers arms get (the first arm also pays one-time CUDA set-up)
            m.generate(prompt, max_new_tokens=args.warmup_tokens, min_new_tokens=args.warmup_tokens, do_sample=False, pad_token_id=0)
        row = {"decode_ms_per_token": decode_ms_per_token(m, prompt, tokens, device, r), "decode_tokens": tokens}
        row["decode_tok_s"] = 1e3 / row["decode_ms_per_token"]
        row["prefill_s"] = prefill_seconds(m, prefill_ids, device, 1 if slow else max(1, reps - 1))
        if device.type == "cuda":
            row["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row.update(extra or {})
        result["arms"][name] = row
        bar.set_postfix_str(f"{name}: {row['decode_ms_per_token']:.1f} ms/token")
        bar.update(1)
        save_partial()

    for name in ("all_gpu", "all_gpu@skewed"):
        if name in arms:
            with routed(model, name):
                measure(name, model, {"experts_implementation": model.config._experts_implementation})

    t0 = time.perf_counter()
    if args.hf_dir:
        src = Path(args.hf_dir)
    model.save_pretrained(src)
    result["save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pack(src, packed, precisions=["bf16", "int8"], overwrite=True, progress=False, device=device)
    result["pack_s"] = time.perf_counter() - t0
    shutil.rmtree(src, ignore_errors=True)
    bar.update(1)

    # Experts to pageable CPU memory, shared by the lazy and accelerate arms.
    cpu_experts = {}
    for layer, (name, m) in mods.items():
        cpu_experts[name] = {n: p.detach().to("cpu") for n, p in m.named_parameters(recurse=False) if p.dim() >= 3}
        for n, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 3:
                m._parameters[n] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if "lazy" in arms:
        if "tiers_lazy_to" not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register("tiers_lazy_to", lazy_experts_forward)
        for name, m in mods.values():
            m._lazy = cpu_experts[name]
        model.set_experts_implementation("tiers_lazy_to")
        try:
            measure("lazy", model, slow=True)
        except Exception as e:  # an arm that fails is reported, the others still run
            failed("lazy", e)

    if "accelerate" in arms:
        for name, m in mods.values():
            for n, t in cpu_experts[name].items():
                m._parameters[n] = torch.nn.Parameter(t, requires_grad=False)
        default_impl = result["arms"].get("all_gpu", {}).get("experts_implementation", "grouped_mm")
        model.set_experts_implementation(default_impl)
        device_map = {"": device.index or 0} | {name: "cpu" for name, _ in mods.values()}
        try:
            from accelerate import dispatch_model  # the baseline only: pip install -e ".[bench]"

            model = dispatch_model(model, device_map=device_map, main_device=device.index or 0)
            measure("accelerate", model, slow=True)
        except Exception as e:
            failed("accelerate", e)
    del model, mods
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # A fresh all-GPU model with the same weights stays beside the Tiers arms: each one is paired
    # with an all-GPU measurement of the same routing, its repetitions interleaved with the arm's
    # (a host whose speed drifts within seconds moves both), and the all-GPU arms are measured on
    # it again at the end.
    tiers_arms = [a for a in arms if a.startswith("tiers_")]
    again = [name for name in ("all_gpu", "all_gpu@skewed") if name in arms]
    paired = build(args.model, shape, device) if tiers_arms or again else None

    counted: dict[str, dict] = {}  # a rebalancing @skewed arm's counted routing, for its @skewed_routed arm

    def tiers_arm(cfg, name):
        # the arm's own GPU memory: the paired all-GPU model stays allocated beside it
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        m = tiers.load(packed, cfg, device=device, progress=False, routing=counted.get(routing_source(name)))
        load_s = time.perf_counter() - t0
        with routed(m, name):
            return tiers_measure(m, load_s, resident, name)

    def interleaved(m, mgr, name) -> dict:
        """The arm and its paired all-GPU model decoding step by step in turn
        (``tools.measure.interleaved_decode``), and the bytes the arm moved over the timed steps."""
        n = args.interleave
        usage: list[list[dict]] = [[], []]
        with routed(paired, name):
            arm_s, pair_s = interleaved_decode([m, paired], prompt, n, device, on_start=mgr.reset_stats, usage=usage)
        moved = {k: v / n for k, v in mgr.stats().bytes_moved.items()}
        diffs = [(a - b) * 1e3 for a, b in zip(arm_s, pair_s)]
        block = args.rebalance_every if rebalances(name) and args.rebalance_every > 0 else INTERLEAVE_BLOCK
        return {"tokens": n, "block": block, "arm_ms_per_token": statistics.fmean(arm_s) * 1e3,
                "pair_ms_per_token": statistics.fmean(pair_s) * 1e3, "overhead_ms_per_token": statistics.fmean(diffs),
                "block_overhead_ms_per_token": statistics.median(block_means(diffs, block)), "bytes_moved_per_token": moved,
                "arm_step_ms": [round(t * 1e3, 3) for t in arm_s], "pair_step_ms": [round(t * 1e3, 3) for t in pair_s],
                "arm_usage": step_usage(usage[0]), "pair_usage": step_usage(usage[1])}

    def tiers_measure(m, load_s, resident, name):
        mgr = manager_of(m)
        arm_reps = max(reps, STATIC_ARM_REPS) if name.startswith("tiers_100") else reps
        kw = dict(do_sample=False, pad_token_id=0)
        gen = lambda n: m.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)  # noqa: E731
        pgen = lambda n: paired.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)  # noqa: E731
        gen(args.warmup_tokens)  # warm-up: kernels, caches, and (skewed arms) the rebalancer's first rounds
        settling: list[int] = []  # hot promotions per warm-up generate: whether the hot set had settled
        if name.endswith("@skewed"):  # the rebalancer's own warm-up, so the timed repetitions see a settled hot set
            for n in rebalance_warmup_generates(args.rebalance_warmup):
                before = rebalancer_counts(mgr)
                gen(n)
                if mgr.rebalancer is not None:
                    settling.append(rebalancer_change(mgr, before)["promoted_hot"])
        gen(1)
        with routed(paired, name):
            pgen(args.warmup_tokens)
        # Decode as in decode_ms_per_token, (generate 1 + T) - (generate 1), and the bytes moved the
        # same way, so the prompt's prefill cancels out of both the time and the bound. Each
        # repetition times the arm and then the paired all-GPU model.
        runs: dict[int, list] = {1: [], args.tokens + 1: []}
        paired_runs: dict[int, list] = {1: [], args.tokens + 1: []}
        rebalanced: list[dict] = []  # what the rebalancer did in each repetition's long generate
        for _ in range(arm_reps):
            for n in runs:
                sync(device)
                mgr.reset_stats()
                before = rebalancer_counts(mgr)
                t0 = time.perf_counter()
                gen(n)
                sync(device)
                elapsed = time.perf_counter() - t0
                st = mgr.stats()
                runs[n].append((elapsed, dict(st.bytes_moved) | {"_stall": st.stall_seconds}))
                if n > 1:
                    rebalanced.append(rebalancer_change(mgr, before))
                graphs = st.graphs  # the last timed generate's decode graphs
                step_graphs = st.step_graphs  # ... and its whole-step graphs (tiers.step_graph)
            with routed(paired, name):
                for n in paired_runs:
                    sync(device)
                    t0 = time.perf_counter()
                    pgen(n)
                    sync(device)
                    paired_runs[n].append(time.perf_counter() - t0)
        one, full = runs[1], runs[args.tokens + 1]
        decode_ms = (statistics.median(t for t, _ in full) - statistics.median(t for t, _ in one)) / args.tokens * 1e3
        paired_decode_ms = (statistics.median(paired_runs[args.tokens + 1]) - statistics.median(paired_runs[1])) / args.tokens * 1e3
        sources = {k for _, b in one + full for k in b}
        per_token = {k: max(0.0, (statistics.mean(b.get(k, 0) for _, b in full) - statistics.mean(b.get(k, 0) for _, b in one)) / args.tokens)
                     for k in sources}
        decode_stall_ms = per_token.pop("_stall") * 1e3  # the compute stream's waits on copies, per decode token
        decode_moved = per_token
        stepped = interleaved(m, mgr, name) if args.interleave else None
        mgr.reset_stats()
        mgr.recorded = []
        m.generate(prompt, max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, do_sample=False, pad_token_id=0)
        sync(device)
        s = tiers.stats(m)
        trace = mgr.recorded
        mgr.recorded = None
        moved = decode_moved
        hot = set(mgr.placement.hot)
        capacity = s.gpu_slots["staging"]
        layers_ = sorted(mgr.manifest.layers)
        n_experts = mgr.manifest.layers[layers_[0]].layout.num_experts
        policy = lambda slots: make_cache(args.cache, slots, layers=layers_, experts=n_experts)  # noqa: E731
        replay_hits = replay(trace, capacity, hot, policy)
        opt_hits = belady_hits(trace, capacity, hot)
        # the whole GPU tier (hot set, rebalancer and cache) against MIN over as many slots, on the
        # lookups of the counted run
        engine_hits = s.hits["gpu"]
        all_slots = s.gpu_slots["hot"] + s.gpu_slots["staging"]
        extra = {
            "reps": arm_reps,
            "load_s": load_s,
            "residency": s.residency,
            "bytes_moved_per_token": moved,
            "h2d_gbps": s.h2d_gbps,
            "stall_ms_per_token": decode_stall_ms,
            "gpu_hit_rate": s.gpu_hit_rate,
            "cache_hits_vs_belady": [replay_hits, opt_hits],
            "gpu_hits_vs_belady": [engine_hits, belady_hits(trace, all_slots, set()), len(trace)],
            "rebalance": s.rebalance,
            "host_compute": s.host_compute,
            "prefetch": s.prefetch,
            "decode_graphs": graphs,
            "step_graphs": step_graphs,
            "host_pinned": bool(s.memory["host_pinned"]),
            # each repetition's decode, the arm's and its pair's (timed one after the other): how
            # far the host's slow phases move single repetitions, which the medians above hide
            "decode_ms_per_rep": [(f - o) / args.tokens * 1e3 for (o, _), (f, _) in zip(one, full)],
            "paired_decode_ms_per_rep": [(f - o) / args.tokens * 1e3 for o, f in zip(paired_runs[1], paired_runs[args.tokens + 1])],
            # and what each repetition moved, per decode token by source, and rebalanced: whether a
            # slow repetition moved more, or came while the hot set was still settling
            "bytes_moved_per_rep": [{k: (fb.get(k, 0) - ob.get(k, 0)) / args.tokens for k in sorted(sources - {"_stall"})}
                                    for (_, ob), (_, fb) in zip(one, full)],
        }
        if mgr.rebalancer is not None:
            extra["rebalance_per_rep"] = rebalanced
            extra["rebalance_warmup_promoted_hot"] = settling
        if routing_source(name):
            extra["routing_from"] = {"arm": routing_source(name), "tokens": counted[routing_source(name)]["tokens"]}
        if stepped is not None:
            extra["interleaved"] = stepped
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        mgr.reset_stats()
        with torch.no_grad():  # the arm's prefill warm-up, alone: its peak GPU memory
            m(prefill_ids)
            sync(device)
        if device.type == "cuda":
            extra["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device) - resident
        # prefill as decode: each repetition times the arm and then the paired model, after one
        # such alternation untimed: the warm-up above only warms the whole-layer graphs up, the
        # next prefill captures them (the first timed prefill was 7-44 ms slower than the next in
        # every arm of bench-qwen3_moe-run42.json, with the rebalancer or without)
        prefill_reps = max(PREFILL_REPS_MIN, arm_reps - 1)
        extra["prefill_reps"] = prefill_reps
        with routed(paired, name):
            with torch.no_grad():
                paired(prefill_ids)
                sync(device)
            noted = PrefillNotes(m, mgr, prefill_ids)
            arm_prefill, pair_prefill = noted, (lambda: paired(prefill_ids))
            extra["prefill_warm_s"] = [t for ts in paired_timings(arm_prefill, pair_prefill, device, 1) for t in ts]
            mgr.reset_stats()  # the timed prefills' bytes only: the warm-ups' whole-layer reads follow no earlier call
            noted.rows.clear()
            arm_s, pair_s = paired_timings(arm_prefill, pair_prefill, device, prefill_reps)
        extra["prefill_notes"] = noted.rows
        extra["prefill_s"], extra["paired_prefill_s"] = statistics.median(arm_s), statistics.median(pair_s)
        # each timed prefill, the arm's and its pair's, in the order they ran: how far a run's
        # slow ones lie from the median (one arm's prefill moved 78-87 ms between runs)
        extra["prefill_s_per_rep"], extra["paired_prefill_s_per_rep"] = arm_s, pair_s
        ps = mgr.stats()
        extra["prefill_bytes_moved"] = sum(ps.bytes_moved.values()) / prefill_reps
        # what whole-layer calls read without a row routed to it (counted in the bytes moved)
        extra["prefill_unused_bytes"] = ps.streamed.get("unused_bytes", 0) / prefill_reps
        extra["prefill_whole_calls"] = ps.streamed.get("whole", 0) / prefill_reps
        extra["prefill_graphs"] = ps.whole_graphs  # whole-layer calls' plans and windows over the timed prefills
        if args.prefill_marks:  # after the timed prefills: where each marked one's time goes (tools.timeline)
            extra["prefill_marks"] = [marked_prefill(m, mgr, prefill_ids) for _ in range(args.prefill_marks)]
        row = {"decode_ms_per_token": decode_ms, "decode_tok_s": 1e3 / decode_ms, "paired_all_gpu_ms_per_token": paired_decode_ms, **extra}
        if name.endswith("@skewed") and mgr.rebalancer is not None and name + "_routed" in arms:
            counted[name] = tiers.routing_counts(m)
        mgr.close()
        return row

    for name in tiers_arms:
        frac, precision = int(name.split("_")[1].split("@")[0]) / 100, name.split("_")[2].split("@")[0].removesuffix(HOST_SUFFIX)
        # the rest of the experts all warm in pinned RAM: a cpu budget that holds every expert
        slots = args.staging_slots if args.staging_slots == "auto" else int(args.staging_slots)
        gpu = {"fraction": frac, "staging_slots": slots}
        if frac == 0:  # no hot experts: just the staging slots and their transit buffers, as the lazy and accelerate arms hold
            n = 2 * top_k if slots == "auto" else slots  # the fewest auto asks for (it takes more for a streamed part's bytes, or experts too large to stack)
            gpu = staging_only_gpu(read_manifest(packed), precision, n)
        cfg = {"tiers": {"gpu": gpu | {"cache": args.cache, "compute": args.compute, "prefetch_depth": args.prefetch_depth,
                                       "decode_graphs": args.decode_graphs == "on"},
                         "cpu": {"budget": expert_bytes, "precision": precision, "compute": HOST_SUFFIX in name}, "nvme": {"precision": precision},
                         # the rebalancer follows skewed routing; under uniform routing it has nothing to
                         # learn, and those arms keep the YAML default (off)
                         "rebalance": {"every_tokens": args.rebalance_every if rebalances(name) else 0}}}
        try:
            row = tiers_arm(cfg, name)
        except Exception as e:
            failed(name, e)
            continue
        row["config"] = cfg
        result["arms"][name] = row
        bar.set_postfix_str(f"{name}: {row['decode_ms_per_token']:.1f} ms/token")
        bar.update(1)
        save_partial()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


    # The all-GPU arms once more: the first measurement also meets a cold machine, and each Tiers
    # arm's bound is held against the faster of the two.
    for name in again:
        with routed(paired, name):
            measure(name + "/end", paired, {"experts_implementation": paired.config._experts_implementation})
    del paired
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # Skewed, sticky routing: what the cache policy gets against Belady on the same trace.
    manifest = read_manifest(packed)
    layers = sorted(manifest.layers)
    n_exp = next(iter(manifest.layers.values())).layout.num_experts
    tm_args = dict(num_layers=len(layers), num_experts=n_exp, top_k=top_k)
    replays = {}
    for label, tm in (("uniform", dict(zipf_s=0.0, reuse_p=0.0)), ("skewed", dict(zipf_s=args.zipf, reuse_p=args.reuse))):
        seq = lookups(TraceModel(**tm_args, **tm, seed=0).sample(256), layers)
        cap = max(1, int(0.25 * len(layers) * n_exp))
        row = {"trace": tm, "capacity": cap, "lookups": len(seq), "belady": belady_hits(seq, cap, set()) / len(seq)}
        for pol in POLICIES:
            row[pol] = replay(seq, cap, set(), lambda slots, pol=pol: make_cache(pol, slots, layers=layers, experts=n_exp)) / len(seq)
        replays[label] = row
    result["cache_replay"] = replays
    if device.type == "cuda" and args.copy_sweep:
        blob = next(iter(manifest.layers.values())).blobs["int8"].stride
        result["copy_sweep"] = copy_sweep(device, [1 << 20, blob, 16 << 20, 64 << 20, 256 << 20])
    if args.cold_read_gb:
        from tiers.tools import coldread

        try:
            result["cold_read"] = coldread.measure(packed, "int8", threads=args.reader_threads, limit_bytes=int(args.cold_read_gb * 1e9),
                                                  rounds=args.cold_read_rounds)
            result["cold_read"]["packed_dir"] = "(the bench's temporary pack)"  # a temporary path says nothing
        except Exception as e:  # reported, the rest of the results still land
            result["cold_read"] = {"error": f"{type(e).__name__}: {e}"}
    bar.update(1)
    bar.close()

    add_bounds(result)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


class PrefillNotes:
    """A Tiers arm's prefill as a callable that notes, per call, what the host saw without a sync
    or a count that waits: the host's time until the forward returned (``host_s``; the timing
    around it adds the device's tail), the whole-layer graphs warmed up, captured and replayed
    meanwhile, the bytes queued for reading, and what the rebalancer did (the change of each of
    its counters); and the CPU time the serving thread spent until the forward returned
    (``host_cpu_s``: near ``host_s`` when its host work ran, below it when it waited: for the
    GIL, a sync) and the process's other threads meanwhile (``others_cpu_s``: readers,
    rebalance threads, torch's intra-op threads, a wait that spins a core). Why: one arm's timed
    prefills split into a fast and a slow group ten ms apart for the same bytes
    (bench-qwen3_moe-run46.json), and the marked prefills after them, which were fast, could not
    tell why."""

    def __init__(self, model, mgr, ids: torch.Tensor):
        self.model, self.mgr, self.ids = model, mgr, ids
        self.rows: list[dict] = []

    def _counters(self) -> dict[str, int]:
        g = self.mgr.whole_graphs
        return {"graphs_eager": g.eager_calls, "graphs_captured": g.captured, "graphs_replayed": g.replayed,
                "queued_bytes": sum(self.mgr.stats_.bytes_moved.values())}

    def __call__(self) -> None:
        before, moves = self._counters(), rebalancer_counts(self.mgr)
        c0, p0 = time.thread_time(), time.process_time()
        t0 = time.perf_counter()
        self.model(self.ids)
        host = time.perf_counter() - t0
        c1, p1 = time.thread_time(), time.process_time()
        after = self._counters()
        self.rows.append({"host_s": host, "host_cpu_s": c1 - c0, "others_cpu_s": max(0.0, (p1 - p0) - (c1 - c0)),
                          **{k: after[k] - v for k, v in before.items()}, "rebalancer": rebalancer_change(self.mgr, moves)})


def staging_only_gpu(manifest, precision: str, n: int) -> dict:
    """The ``tiers.gpu`` section of the staging-slots arm: a budget of exactly ``n`` staging slots
    and their transit rows (as the placement counts them), so no expert is hot. Every MoE layer
    of the bench's models has one expert shape."""
    from tiers.policy import transit_rows

    entry = next(iter(manifest.layers.values()))
    blob = entry.blobs[precision] if precision != "bf16" else None
    rows = transit_rows(n, blob.nbytes) if blob else 0
    return {"budget": n * entry.layout.nbytes() + rows * (blob.stride if blob else 0), "staging_slots": n}


def paired_timings(arm, pair, device, reps: int) -> tuple[list[float], list[float]]:
    """Seconds of ``arm()`` and of ``pair()`` (both warmed up by the caller), timed alternately
    ``reps`` times, arm first, so a host whose speed drifts moves both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    with torch.no_grad():
        for _ in range(reps):
            for fn, out in zip((arm, pair), times):
                t0 = time.perf_counter()
                fn()
                sync(device)
                out.append(time.perf_counter() - t0)
    return times


def baseline(result: dict, name: str) -> dict:
    """The all-GPU arm of the same routing an arm is held against: the faster of its measurements
    (start and end of the run) for decode and for prefill, each."""
    first = "all_gpu@skewed" if "@skewed" in name else "all_gpu"
    rows = [r for r in (result["arms"].get(first), result["arms"].get(first + "/end")) if r and "error" not in r]
    out = {}
    for key in ("decode_ms_per_token", "prefill_s"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = min(values)
    return out


def rep_overhead_ms(row: dict) -> float | None:
    """The median over repetitions of (the arm's decode ms/token - its paired all-GPU model's in
    the same repetition): each difference is taken within one repetition, so a slow phase of the
    host that falls on one repetition moves both of its terms, where the difference of the two
    medians can pair a fast repetition of one with a slow one of the other. None without the
    per-repetition lists."""
    arm, pair = row.get("decode_ms_per_rep"), row.get("paired_decode_ms_per_rep")
    if not arm or not pair or len(arm) != len(pair):
        return None
    return statistics.median(a - b for a, b in zip(arm, pair))


# Steps per block of the interleaved decode's block statistic for arms without the rebalancer
# (with it: one rebalance interval, so each block holds one rebalance)
INTERLEAVE_BLOCK = 8


def step_usage(steps: list[dict]) -> dict[str, list]:
    """``interleaved_decode``'s per-step usage as one list per field (ms to 0.01)."""
    keys = steps[0].keys() if steps else ()
    return {k: [round(u[k], 2) if isinstance(u[k], float) else u[k] for u in steps] for k in keys}


def phase_usage(usage: dict[str, list], block: int) -> dict[str, dict[str, float]] | None:
    """The fastest and the slowest block of ``block`` steps by the median host time (``step_usage``
    lists): the medians of each field in each, and the faults and preemptions per step over all.
    Why: the serving thread's CPU time growing with its wall time from one block to another says
    the host computed slower (a slow phase of the machine); wall time growing alone, that it
    waited (the GIL, another process); system time or faults growing, that the kernel worked."""
    n = len(usage.get("host_ms", ()))
    if n < block:
        return None
    blocks = [{k: statistics.median(v[i:i + block]) for k, v in usage.items()} for i in range(0, n - block + 1, block)]
    fast, slow = min(blocks, key=lambda b: b["host_ms"]), max(blocks, key=lambda b: b["host_ms"])
    return {"fastest": fast, "slowest": slow, "per_step": {k: sum(usage[k]) / n for k in ("faults", "preempted")}}


def interleaved_bounds(row: dict) -> None:
    """The interleaved decode's bytes bound (its own steps' bytes / 55 GB/s) and each overhead over it."""
    il = row.get("interleaved")
    if not il:
        return
    il["bound_ms"] = sum(il["bytes_moved_per_token"].values()) / H2D_BYTES_PER_S * 1e3
    for key in ("overhead", "block_overhead"):
        il[f"{key}_over_bytes_bound"] = il[f"{key}_ms_per_token"] / il["bound_ms"] if il["bound_ms"] else None


REBALANCE_WARMUP_GENERATE = 64  # tokens per generate of the rebalancer's warm-up, at most (a short KV cache)


def rebalances(name: str) -> bool:
    """Whether a Tiers arm runs the rebalancer: ``@skewed`` and ``@skewed_routed`` ones."""
    return name.endswith(("@skewed", "@skewed_routed"))


def routing_source(name: str) -> str | None:
    """The arm whose counted routing a ``@skewed_routed`` arm loads with; None for other arms."""
    return name[: -len("_routed")] if name.endswith("@skewed_routed") else None


def attention_warmup_tokens(args) -> int:
    """New tokens of the generate that warms attention before any arm: enough for a decode step
    at every KV length the run decodes at (its warm-up, timed and rebalancer warm-up generates,
    the lazy and accelerate arms', and the interleaved steps, untimed ones included)."""
    return max(args.warmup_tokens, args.tokens + 1, args.slow_tokens + 1, REBALANCE_WARMUP_GENERATE if args.rebalance_warmup > 0 else 0,
               args.interleave + INTERLEAVE_SKIP + 1 if args.interleave else 0)


def warm_attention(model, prompt, tokens: int, device) -> dict:
    """Generate ``tokens`` twice with the all-GPU model before any arm runs, and time both.

    Why: torch's attention builds a cuDNN plan the first time it meets a shape, where cuDNN is
    among its backends (torch 2.11 on the H200), and decode meets a new KV length at each step:
    on the H200's host each new length took about 5 ms per attention layer, tens of ms per
    step, once per process (``bench/results/step_probe-*.json``). Unwarmed, whichever arm first
    decoded at a length paid for it: the Tiers 100% arm, the first after the all-GPU arm to
    decode past its lengths, in the interleaved steps beyond them. The plans are kept per
    shape, so one model's generate warms every arm's attention."""
    times = []
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        sync(device)
        times.append(time.perf_counter() - t0)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled() if device.type == "cuda" else None
    return {"tokens": tokens, "first_s": times[0], "second_s": times[1], "cudnn_sdp": cudnn}


def rebalance_warmup_generates(tokens: int) -> list[int]:
    """The generates of ``--rebalance-warmup``: ``tokens`` split into generates of at most
    ``REBALANCE_WARMUP_GENERATE`` tokens."""
    full, rest = divmod(max(0, tokens), REBALANCE_WARMUP_GENERATE)
    return [REBALANCE_WARMUP_GENERATE] * full + ([rest] if rest else [])


def bytes_bound_ms(row: dict) -> float:
    """An arm's bytes moved per decode token at 55 GB/s, in ms."""
    return sum(row["bytes_moved_per_token"].values()) / H2D_BYTES_PER_S * 1e3


def add_bounds(result: dict) -> dict:
    """Per Tiers arm: the decode bound (all-GPU ms/token of the same routing + moved bytes / 55 GB/s),
    the overhead over it, and the prefill bound max(all-GPU prefill, prefill bytes / 55 GB/s).
    Figures against the arm's own pairs (per repetition, interleaved, paired prefill) need no
    all-GPU arm of its routing in the run and are derived without one; the others are left out."""
    for name, row in result["arms"].items():
        if not name.startswith("tiers") or "error" in row:
            continue
        baseline_ = baseline(result, name)
        base = baseline_.get("decode_ms_per_token")
        bytes_ms = bytes_bound_ms(row)
        if base is not None:
            row["bound_ms_per_token"] = base + bytes_ms
            row["overhead_ms_per_token"] = row["decode_ms_per_token"] - base
            row["overhead_over_bytes_bound"] = (row["overhead_ms_per_token"] / bytes_ms) if bytes_ms else None
        pair = row.get("paired_all_gpu_ms_per_token")
        if pair is not None:  # against the all-GPU measurement interleaved with the arm's
            row["over_paired_all_gpu"] = row["decode_ms_per_token"] / pair
            row["paired_overhead_over_bytes_bound"] = ((row["decode_ms_per_token"] - pair) / bytes_ms) if bytes_ms else None
        interleaved_bounds(row)
        reps = rep_overhead_ms(row)
        if reps is not None:  # each repetition's arm less its pair, timed one after the other
            row["rep_overhead_ms_per_token"] = reps
            row["rep_overhead_over_bytes_bound"] = reps / bytes_ms if bytes_ms else None
        if baseline_.get("prefill_s") is not None:
            row["prefill_bound_s"] = max(baseline_["prefill_s"], row["prefill_bytes_moved"] / H2D_BYTES_PER_S)
            row["prefill_over_bound"] = row["prefill_s"] / row["prefill_bound_s"]
        if row.get("paired_prefill_s") is not None:  # the same bound with the interleaved all-GPU prefill
            row["paired_prefill_bound_s"] = max(row["paired_prefill_s"], row["prefill_bytes_moved"] / H2D_BYTES_PER_S)
            row["prefill_over_paired_bound"] = row["prefill_s"] / row["paired_prefill_bound_s"]
    offload = offload_overheads(result)
    if offload:
        result["offload"] = offload
    return result


# The offload target: a Tiers arm's overhead per token at least this many times smaller than
# accelerate's and naive lazy's (all three above the faster all-GPU measurement of their routing)
OFFLOAD_TARGETS = {"accelerate": 50.0, "lazy": 10.0}


def offload_overheads(result: dict) -> dict:
    """Per offloaded Tiers arm (not the 100% one): its decode overhead per token above all-GPU by
    each statistic the bench has (against the faster all-GPU measurement of its routing, the
    median per repetition against its pair, the interleaved steps' mean), the largest of them,
    and accelerate's and naive lazy's overhead above the faster uniform all-GPU measurement over
    that largest one (None where the largest is not above zero: the arm is not slower than
    all-GPU by any statistic). Empty without the accelerate and lazy arms."""
    slow = {}
    for name in OFFLOAD_TARGETS:
        row, base = result["arms"].get(name), baseline(result, name).get("decode_ms_per_token")
        if row and "error" not in row and base is not None:
            slow[name] = row["decode_ms_per_token"] - base
    out = {}
    if len(slow) < len(OFFLOAD_TARGETS):
        return out
    for name, row in result["arms"].items():
        if not name.startswith("tiers") or name.startswith("tiers_100") or "overhead_ms_per_token" not in row:
            continue
        il = row.get("interleaved") or {}
        stats = {"faster_all_gpu": row["overhead_ms_per_token"], "per_rep": row.get("rep_overhead_ms_per_token"),
                 "interleaved": il.get("overhead_ms_per_token")}
        stats = {k: v for k, v in stats.items() if v is not None}
        largest = max(stats.values())
        out[name] = {"overhead_ms": stats, "largest_ms": largest,
                     **{f"{k}_over": (v / largest if largest > 0 else None) for k, v in slow.items()}}
    return {"overhead_ms": slow, "arms": out} if out else {}


def attention_warmup_lines(w: dict | None) -> list[str]:
    """The Markdown's note of the attention warm-up (none for runs without it)."""
    if not w:
        return []
    return [f"Attention warmed before any arm: the all-GPU model generated {w['tokens']} tokens twice, in {w['first_s']:.2f} s "
            f"and then {w['second_s']:.2f} s (cuDNN among torch's attention backends: {w['cudnn_sdp']}).", ""]


def markdown(r: dict) -> str:
    mib = 2**20
    lines = [f"# Bench: {r['model']} ({r['shape']['layers']} layers) on {r['device']}", "",
             f"Command: `{r['command']}`", "",
             *([] if "cache_replay" in r else [
                 "This run ended after its arms, before its end-of-run measurements (the cache policies' replays, the copy "
                 "sweep, the cold reads): these tables are from the JSON it had written by then (`bench-<model>.partial.json`, "
                 "read by `--report`).", ""]),
             f"Experts: {r['experts']}, {r['expert_bytes_bf16'] / 2**30:.2f} GiB at bf16. Decode: batch 1, {r['decode_tokens']} tokens; "
             f"prefill: {r['prefill_tokens']} tokens. Arms named `@skewed` route by the skewed trace {r['routing']['skewed']} (Tiers with the rebalancer on; `_norebal`: off; `_routed`: on, loaded with the routing its `@skewed` arm counted, no rebalancer warm-up).", "",
             *attention_warmup_lines(r.get("attention_warmup")),
             "| arm | decode ms/token | tok/s | bound ms/token | overhead / bytes bound | paired all-GPU ms/token (ratio; overhead / bytes) "
             "| prefill s | prefill / bound (paired) | MiB moved/token (cpu, nvme, rebalance) "
             "| H2D GB/s | GPU hit rate | GPU hits / Belady | prefetch accuracy | peak GPU GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in r["arms"].items():
        if "error" in a:
            lines.append(f"| {name} | error: {a['error']} |" + " |" * 12)
            continue
        pair = a.get("paired_all_gpu_ms_per_token")
        pair_text = "-" if pair is None else (
            f"{pair:.1f} ({a['over_paired_all_gpu']:.2f}" + (f"; {a['paired_overhead_over_bytes_bound']:.2f})" if a.get("paired_overhead_over_bytes_bound") is not None else ")")
            if "over_paired_all_gpu" in a else f"{pair:.1f}")
        moved = a.get("bytes_moved_per_token")
        vs = a.get("gpu_hits_vs_belady")
        lines.append("| " + " | ".join([
            name, f"{a['decode_ms_per_token']:.1f}", f"{a['decode_tok_s']:.2f}",
            f"{a['bound_ms_per_token']:.1f}" if "bound_ms_per_token" in a else "-",
            f"{a['overhead_over_bytes_bound']:.2f}" if a.get("overhead_over_bytes_bound") is not None else "-",
            pair_text,
            f"{a['prefill_s']:.3f}",
            (f"{a['prefill_over_bound']:.2f}" + (f" ({a['prefill_over_paired_bound']:.2f})" if "prefill_over_paired_bound" in a else "")
             + (f"; {a['prefill_unused_bytes'] / a['prefill_bytes_moved']:.0%} read in vain" if a.get("prefill_unused_bytes") else ""))
            if "prefill_over_bound" in a else "-",
            f"{moved.get('cpu', 0) / mib:.1f}, {moved.get('nvme', 0) / mib:.1f}, {moved.get('rebalance', 0) / mib:.1f}" if moved else "-",
            f"{a['h2d_gbps']:.1f}" if "h2d_gbps" in a else "-",
            f"{a['gpu_hit_rate']:.2f}" if "gpu_hit_rate" in a else "-",
            f"{vs[0] / vs[1]:.2f} ({vs[0]}/{vs[1]})" if vs and vs[1] else "-",
            f"{a['prefetch']['accuracy']:.2f}" if a.get("prefetch", {}).get("issued") else "-",
            f"{a['gpu_peak_bytes'] / 2**30:.1f}" if "gpu_peak_bytes" in a else "-",
        ]) + " |")
    reps = [(name, a) for name, a in r["arms"].items() if a.get("rep_overhead_ms_per_token") is not None]
    if reps:
        lines += ["", "Decode overhead per repetition: the median over repetitions of the arm's ms/token less its paired all-GPU "
                  "model's in the same repetition, and that over the bytes bound:", "",
                  "| arm | overhead ms/token | over bytes bound |", "|---|---|---|"]
        lines += [f"| {name} | {a['rep_overhead_ms_per_token']:.2f} | "
                  + ("-" if a.get("rep_overhead_over_bytes_bound") is None else f"{a['rep_overhead_over_bytes_bound']:.2f}") + " |"
                  for name, a in reps]
    stepped = [(name, a["interleaved"]) for name, a in r["arms"].items() if a.get("interleaved")]
    if stepped:
        lines += ["", "Decode interleaved step by step: the arm and its paired all-GPU model taking turns, each step timed alone "
                  "(the host's slow phases move both alike); the overhead as the mean of the per-step differences and as "
                  "the median over blocks of steps (one rebalance interval each) of their means, each also over the bytes "
                  "bound of the same steps:", "",
                  "| arm | steps | arm ms/token | pair ms/token | MiB moved/token | bytes bound ms | overhead ms (/ bound) "
                  "| block median ms (/ bound) |", "|---|---|---|---|---|---|---|---|"]

        def over(x):
            return "-" if x is None else f"{x:.2f}"
        for name, il in stepped:
            lines.append(f"| {name} | {il['tokens']} | {il['arm_ms_per_token']:.2f} | {il['pair_ms_per_token']:.2f} "
                         f"| {sum(il['bytes_moved_per_token'].values()) / mib:.1f} | {over(il.get('bound_ms'))} "
                         f"| {il['overhead_ms_per_token']:.2f} ({over(il.get('overhead_over_bytes_bound'))}) "
                         f"| {il['block_overhead_ms_per_token']:.2f} ({over(il.get('block_overhead_over_bytes_bound'))}) |")
        phases = [(name, phase_usage(il["pair_usage"], il["block"])) for name, il in stepped if il.get("pair_usage")]
        phases = [(name, p) for name, p in phases if p]
        if phases:
            lines += ["", "The host's speed over those steps, read off the paired all-GPU model's: in its fastest and its slowest "
                      "block of steps (by the median time its forward took to return), the medians of that time and of the "
                      "serving thread's CPU time meanwhile (system time apart), and its page faults and involuntary context "
                      "switches per step over all steps:", "",
                      "| arm | fastest block: host ms, CPU ms | slowest block: host ms, CPU ms, system ms | faults per step "
                      "| preempted per step |", "|---|---|---|---|---|"]
            for name, p in phases:
                f, w = p["fastest"], p["slowest"]
                lines.append(f"| {name} | {f['host_ms']:.2f}, {f['cpu_ms']:.2f} | {w['host_ms']:.2f}, {w['cpu_ms']:.2f}, "
                             f"{w['sys_ms']:.2f} | {p['per_step']['faults']:.2f} | {p['per_step']['preempted']:.2f} |")
    noted = [(name, a) for name, a in r["arms"].items() if a.get("prefill_notes")]
    if noted:
        lines += ["", "Each timed prefill of a Tiers arm, in order: its time, its paired all-GPU prefill's (the host's speed "
                  "then), the host's time until the forward returned, the serving thread's CPU time meanwhile and the "
                  "other threads' (where recorded), the whole-layer graphs it captured (and warmed up), the hot promotions "
                  "that landed in it:", "",
                  "| arm | prefill ms | paired all-GPU ms | host ms | serving CPU ms | others' CPU ms | graphs captured (warmed) "
                  "| hot promotions |", "|---|---|---|---|---|---|---|---|"]
        for name, a in noted:
            notes = a["prefill_notes"]
            cpu = ("host_cpu_s", "others_cpu_s")
            cells = [", ".join(f"{t * 1e3:.1f}" for t in a["prefill_s_per_rep"]),
                     ", ".join(f"{t * 1e3:.1f}" for t in a.get("paired_prefill_s_per_rep", ())) or "-",
                     ", ".join(f"{n['host_s'] * 1e3:.1f}" for n in notes),
                     *(", ".join(f"{n[k] * 1e3:.1f}" if k in n else "-" for n in notes) for k in cpu),
                     ", ".join(f"{n['graphs_captured']} ({n['graphs_eager']})" for n in notes),
                     ", ".join(str(n["rebalancer"].get("promoted_hot", "-")) for n in notes)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    synced = [(name, [m.get("host_syncs") for m in a.get("prefill_marks", ())]) for name, a in r["arms"].items()]
    synced = [(name, marks) for name, marks in synced if any(marks)]
    if synced:
        lines += ["", "Synchronizing calls in each marked prefill's forward (torch's sync debug mode), where the library made them:", ""]
        for name, marks in synced:
            for i, sites in enumerate(marks):
                counts = collections.Counter(sites or ())
                lines.append(f"- {name}, marked prefill {i + 1}: " + ("; ".join(f"{s} x{n}" for s, n in counts.items()) or "none"))
    offload = r.get("offload")  # add_bounds' offload_overheads
    if offload:
        slow = offload["overhead_ms"]
        lines += ["", f"Offload overhead per token, ms above all-GPU: accelerate {slow['accelerate']:.1f}, naive lazy "
                  f"{slow['lazy']:.1f} (against the faster uniform all-GPU measurement); each Tiers arm by every statistic "
                  "above (against the faster all-GPU measurement of its routing, per repetition, interleaved), and theirs "
                  "over its largest (target: at least "
                  + " and ".join(f"{v:.0f}x {k}'s" for k, v in OFFLOAD_TARGETS.items()) + "; '-': not slower than all-GPU by any):", "",
                  "| arm | against faster all-GPU | per repetition | interleaved | largest | accelerate's over it | lazy's over it |",
                  "|---|---|---|---|---|---|---|"]

        def ms(x):
            return "-" if x is None else f"{x:.2f}"

        def times(x):
            return "-" if x is None else f"{x:.1f}x"
        for name, a in offload["arms"].items():
            o = a["overhead_ms"]
            lines.append(f"| {name} | {ms(o.get('faster_all_gpu'))} | {ms(o.get('per_rep'))} | {ms(o.get('interleaved'))} "
                         f"| {ms(a['largest_ms'])} | {times(a['accelerate_over'])} | {times(a['lazy_over'])} |")
    if r.get("cache_replay"):
        lines += ["", "Cache policy alone against Belady's MIN on synthetic traces (capacity 25% of experts, no pinned set):", "",
                  "| trace | lookups | belady | lru | lfu | forecast | markov | forecast / belady | markov / belady |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for label, row in r.get("cache_replay", {}).items():
        markov = row.get("markov")  # results from before the markov policy have none
        lines.append(f"| {label} {row['trace']} | {row['lookups']} | {row['belady']:.3f} | {row['lru']:.3f} | {row['lfu']:.3f} "
                     f"| {row['forecast']:.3f} | " + ("-" if markov is None else f"{markov:.3f}")
                     + f" | {row['forecast'] / row['belady']:.3f} | " + ("-" if markov is None else f"{markov / row['belady']:.3f}") + " |")
    if r.get("copy_sweep"):
        lines += ["", "H2D from pinned memory, one stream: back-to-back copies of one size against one copy of the same bytes:", "",
                  "| copy MiB | copies | separate GB/s | one copy GB/s |", "|---|---|---|---|"]
        for row in r["copy_sweep"]:
            lines.append(f"| {row['size'] / mib:.2f} | {row['copies']} | {row['separate_gbps']:.1f} | {row['one_copy_gbps']:.1f} |")
    if r.get("cold_read"):
        lines += ["", "Cold reads (page cache dropped) against O_DIRECT, same blobs, same run:", "", "```",
                  json.dumps(r["cold_read"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def report(path: Path) -> int:
    """``--report``: the Markdown of a bench JSON written by this tool, its bounds and summaries
    derived again, next to it (the JSON itself is left as it is)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"--report {path}: not a readable bench JSON ({e})")
    if not isinstance(result, dict) or not isinstance(result.get("arms"), dict) or "command" not in result:
        sys.exit(f"--report {path}: not a bench JSON (no 'arms' or 'command')")
    md = markdown(add_bounds(result))
    path.with_suffix(".md").write_text(md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="tiers-bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--layers", type=int, help="MoE layers (default: 8 for mixtral, 12 for qwen3_moe)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per timed run")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill length")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    ap.add_argument("--interleave", type=int, default=192,
                    help="Tiers arms: decode steps timed in turn with the paired all-GPU model, after the repetitions (0: skip)")
    ap.add_argument("--prefill-marks", type=int, default=0,
                    help="Tiers arms: this many more prefills after the timed ones, each with a timeline of its copies, "
                         "layer boundaries and host time (tools.timeline.marked_prefill; 0: none)")
    ap.add_argument("--slow-tokens", type=int, default=4, help="decode tokens for the lazy and accelerate arms (one timed run)")
    ap.add_argument("--hf-dir", help="where to write the save_pretrained checkpoint before packing (e.g. a tmpfs)")
    ap.add_argument("--arms", default="all", help="comma-separated arms, or all")
    ap.add_argument("--staging-slots", default="auto", help="Tiers staging slots: an integer or auto (the YAML default)")
    ap.add_argument("--cache", choices=POLICIES, default=TiersConfig().gpu.cache, help="the staging-slot policy of every Tiers arm (default: the YAML default)")
    ap.add_argument("--rebalance-every", type=int, default=8, help="Tiers @skewed arms: rebalance the tiers every this many tokens (0: off)")
    ap.add_argument("--zipf", type=float, default=1.2, help="skewed routing: per-layer Zipf exponent")
    ap.add_argument("--reuse", type=float, default=0.5, help="skewed routing: probability a token reuses an expert of the previous one")
    ap.add_argument("--copy-sweep", action="store_true", help="measure H2D GB/s per copy size (CUDA)")
    ap.add_argument("--cold-read-gb", type=float, default=0.0, help="measure cold reads of this many GB against O_DIRECT (0: skip)")
    ap.add_argument("--cold-read-rounds", type=int, default=2,
                    help="rounds of the cold-read passes, odd ones in reverse order (2: each pass once early and once late)")
    ap.add_argument("--reader-threads", type=int, default=4)
    ap.add_argument("--warmup-tokens", type=int, default=32, help="tokens generated before timing (all arms but lazy and accelerate)")
    ap.add_argument("--attention-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="before any arm, generate with the all-GPU model at every KV length the run decodes at, twice, timed: "
                         "torch's attention builds a plan per new shape where cuDNN is among its backends (--no-attention-warmup: "
                         "the runs up to Qwen3's 51 and Mixtral's 39)")
    ap.add_argument("--rebalance-warmup", type=int, default=0,
                    help="Tiers @skewed arms with the rebalancer: this many more tokens generated before timing, so the timed "
                         "repetitions see a settled hot set (0: none, the rebalancer still settling while timed)")
    ap.add_argument("--compute", choices=["grouped", "eager"], default="grouped", help="Tiers experts kernels")
    ap.add_argument("--prefetch-depth", type=int, default=0, help="Tiers lookahead prefetch depth (0: off)")
    ap.add_argument("--decode-graphs", choices=["on", "off"], default="on" if TiersConfig().gpu.decode_graphs else "off",
                    help="Tiers decode graphs (tiers.gpu.decode_graphs; default: the YAML default)")
    ap.add_argument("--direct-decode-mib", default=None,
                    help="Tiers: the largest expert (MiB in transfer form) direct decode reads, or 'any' "
                         "(default: the library's TierManager.DECODE_BYTES)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--workdir", help="keep the checkpoint and the pack here")
    ap.add_argument("--out", default="bench/results", help="directory for bench-<model>.json and .md")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run of the harness")
    ap.add_argument("--report", metavar="JSON",
                    help="run nothing: rewrite the Markdown beside this bench JSON from it (figures derived again); also the "
                         "partial JSON of a run that did not finish")
    args = ap.parse_args(argv)
    if args.report:
        return report(Path(args.report))
    block = max(INTERLEAVE_BLOCK, args.rebalance_every)
    if args.interleave < 0 or 0 < args.interleave < block:
        ap.error(f"--interleave: expected 0 or at least one block of {block} steps, got {args.interleave}")
    if args.prefill_marks < 0:
        ap.error(f"--prefill-marks: expected a count >= 0, got {args.prefill_marks}")
    if args.rebalance_warmup < 0:
        ap.error(f"--rebalance-warmup: expected a token count >= 0, got {args.rebalance_warmup}")
    if args.cold_read_gb and not 1 <= args.cold_read_rounds <= 64:  # refused now, not after the arms have run
        ap.error(f"--cold-read-rounds: expected an integer in [1, 64], got {args.cold_read_rounds}")
    listed = args.arms.split(",") if args.arms != "all" else []
    for i, name in enumerate(listed):  # a routed arm loads what its @skewed arm counted: that arm runs first
        source = routing_source(name)
        if source is not None and not name.startswith("tiers_"):
            ap.error(f"--arms: {name}: only Tiers arms load a routing file")
        if source is not None and source not in listed[:i]:
            ap.error(f"--arms: {name} loads the routing that {source} counted; list {source} before it")
    from tiers.engine import TierManager

    bound = TierManager.DECODE_BYTES
    if args.direct_decode_mib is not None:
        try:
            bound = None if args.direct_decode_mib == "any" else int(float(args.direct_decode_mib) * 2**20)
        except ValueError:
            ap.error(f"--direct-decode-mib: expected a size in MiB or 'any', got {args.direct_decode_mib!r}")
    args.argv = argv
    default, TierManager.DECODE_BYTES = TierManager.DECODE_BYTES, bound  # read when each arm's first decode stage builds its tables
    try:
        result = run(args)
    finally:
        TierManager.DECODE_BYTES = default
    out = Path(args.out)
    stem = f"bench-{args.model}{'-tiny' if args.tiny else ''}"
    write_result(out / f"{stem}.json", result)
    md = markdown(result)
    (out / f"{stem}.md").write_text(md)
    (out / f"bench-{args.model}.partial.json").unlink(missing_ok=True)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
