"""One Tiers arm of the bench, measured against the paired all-GPU model of the same routing.

Its decode repetitions, interleaved decode steps and prefills each take turns with the paired
model, so a host whose speed drifts within seconds moves both alike; one more counted decode
replays the cache policy and Belady's MIN on the arm's own lookups. The runtime's internals are
reached through ``tools.bench_runtime`` only.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import tiers
from tiers.tools.bench_arms import rebalances, routed, routing_source
from tiers.tools.bench_runtime import Manager, belady
from tiers.tools.measure import block_means, interleaved_decode, sync

# Tiers at 100% runs the all-GPU model's kernels; against its paired all-GPU model it measured
# 1.11x, 0.94x and 1.20x over two repetitions and 1.00x over fifteen (bench-qwen3_moe-run21-t100.md).
STATIC_ARM_REPS = 9
# Timed prefills per Tiers arm, at least: a prefill costs a fraction of a decode repetition, and with
# one (--reps 2) a slow phase of the host decided the ratio (Mixtral's run 35: its three 25% INT8
# arms at 1.22-1.33x against 1.05-1.06x in run 34, with the same bytes and graph counts).
PREFILL_REPS_MIN = 3
# Steps per block of the interleaved decode's block statistic for arms without the rebalancer
# (with it: one rebalance interval, so each block holds one rebalance)
INTERLEAVE_BLOCK = 8
REBALANCE_WARMUP_GENERATE = 64  # tokens per generate of the rebalancer's warm-up, at most (a short KV cache)


@dataclass
class Setting:
    """What every Tiers arm of a run is measured with."""

    args: argparse.Namespace  # the run's flags
    device: torch.device
    packed: Path  # the pack every arm loads
    prompt: torch.Tensor  # [1, 16] token ids
    prefill_ids: torch.Tensor  # [1, --prefill] token ids
    paired: torch.nn.Module  # the all-GPU model beside the arms
    arms: list[str]  # every arm of the run
    skew: dict  # the skewed trace's parameters
    counted: dict[str, dict]  # a rebalancing @skewed arm's counted routing, for its @skewed_routed arm

    def routed(self, model, name: str):
        return routed(model, name, self.skew, max(4096, 2 * self.args.prefill))


def generator(model, prompt):
    """``n`` -> greedy generate of exactly ``n`` new tokens from ``prompt``."""
    return lambda n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def rebalance_warmup_generates(tokens: int) -> list[int]:
    """The generates of ``--rebalance-warmup``: ``tokens`` split into generates of at most
    ``REBALANCE_WARMUP_GENERATE`` tokens."""
    full, rest = divmod(max(0, tokens), REBALANCE_WARMUP_GENERATE)
    return [REBALANCE_WARMUP_GENERATE] * full + ([rest] if rest else [])


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


def step_usage(steps: list[dict]) -> dict[str, list]:
    """``interleaved_decode``'s per-step usage as one list per field (ms to 0.01)."""
    keys = steps[0].keys() if steps else ()
    return {k: [round(u[k], 2) if isinstance(u[k], float) else u[k] for u in steps] for k in keys}


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

    def __init__(self, model, mgr: Manager, ids: torch.Tensor):
        self.model, self.mgr, self.ids = model, mgr, ids
        self.rows: list[dict] = []

    def __call__(self) -> None:
        before, moves = self.mgr.prefill_counters(), self.mgr.rebalancer_counts()
        c0, p0 = time.thread_time(), time.process_time()
        t0 = time.perf_counter()
        self.model(self.ids)
        host = time.perf_counter() - t0
        c1, p1 = time.thread_time(), time.process_time()
        after = self.mgr.prefill_counters()
        self.rows.append({"host_s": host, "host_cpu_s": c1 - c0, "others_cpu_s": max(0.0, (p1 - p0) - (c1 - c0)),
                          **{k: after[k] - v for k, v in before.items()}, "rebalancer": self.mgr.rebalancer_change(moves)})


def run_arm(s: Setting, cfg: dict, name: str) -> dict:
    """Load Tiers arm ``name`` with ``cfg`` and measure it (``measure``), under its routing."""
    # the arm's own GPU memory: the paired all-GPU model stays allocated beside it
    resident = torch.cuda.memory_allocated(s.device) if s.device.type == "cuda" else 0
    t0 = time.perf_counter()
    m = tiers.load(s.packed, cfg, device=s.device, progress=False, routing=s.counted.get(routing_source(name)))
    load_s = time.perf_counter() - t0
    with s.routed(m, name):
        return measure(s, m, load_s, resident, name)


def measure(s: Setting, m, load_s: float, resident: int, name: str) -> dict:
    """The arm's row: decode against its paired all-GPU model, the interleaved steps, the counted
    run's statistics and replays, and its prefills; the manager closed after."""
    mgr = Manager.of(m)
    arm_reps = max(s.args.reps, STATIC_ARM_REPS) if name.startswith("tiers_100") else s.args.reps
    settling = warm_up(s, m, mgr, name)
    d = timed_decode(s, m, mgr, name, arm_reps)
    stepped = interleaved(s, m, mgr, name) if s.args.interleave else None
    st, replays = counted_run(s, m, mgr)
    extra = {
        "reps": arm_reps,
        "load_s": load_s,
        "residency": st.residency,
        "bytes_moved_per_token": d["moved"],
        "h2d_gbps": st.h2d_gbps,
        "stall_ms_per_token": d["stall_ms"],
        "gpu_hit_rate": st.gpu_hit_rate,
        **replays,
        "rebalance": st.rebalance,
        "read_ahead": st.read_ahead,
        "decode_graphs": d["graphs"],
        "step_graphs": d["step_graphs"],
        "host_pinned": bool(st.memory["host_pinned"]),
        # each repetition's decode, the arm's and its pair's (timed one after the other), what it
        # moved per decode token by source: see ``decode_figures``
        **{k: d[k] for k in ("decode_ms_per_rep", "paired_decode_ms_per_rep", "bytes_moved_per_rep")},
    }
    if mgr.rebalancing:
        extra["rebalance_per_rep"] = d["rebalanced"]
        extra["rebalance_warmup_promoted_hot"] = settling
    if routing_source(name):
        extra["routing_from"] = {"arm": routing_source(name), "tokens": s.counted[routing_source(name)]["tokens"]}
    if stepped is not None:
        extra["interleaved"] = stepped
    extra.update(prefill(s, m, mgr, name, arm_reps, resident))
    row = {"decode_ms_per_token": d["decode_ms"], "decode_tok_s": 1e3 / d["decode_ms"], "paired_all_gpu_ms_per_token": d["paired_decode_ms"],
           **extra}
    if name.endswith("@skewed") and mgr.rebalancing and name + "_routed" in s.arms:
        s.counted[name] = tiers.routing_counts(m)
    mgr.close()
    return row


def warm_up(s: Setting, m, mgr: Manager, name: str) -> list[int]:
    """The arm's warm-up, the rebalancer's own for ``@skewed`` arms, then the paired model's; the
    hot promotions per rebalancer warm-up generate (whether the hot set had settled)."""
    gen = generator(m, s.prompt)
    gen(s.args.warmup_tokens)  # warm-up: kernels, caches, and (skewed arms) the rebalancer's first rounds
    settling: list[int] = []  # hot promotions per warm-up generate: whether the hot set had settled
    if name.endswith("@skewed"):  # the rebalancer's own warm-up, so the timed repetitions see a settled hot set
        for n in rebalance_warmup_generates(s.args.rebalance_warmup):
            before = mgr.rebalancer_counts()
            gen(n)
            if mgr.rebalancing:
                settling.append(mgr.rebalancer_change(before)["promoted_hot"])
    gen(1)
    with s.routed(s.paired, name):
        generator(s.paired, s.prompt)(s.args.warmup_tokens)
    return settling


def timed_decode(s: Setting, m, mgr: Manager, name: str, reps: int) -> dict:
    """Decode as in decode_ms_per_token, (generate 1 + T) - (generate 1), and the bytes moved the
    same way, so the prompt's prefill cancels out of both the time and the bound. Each
    repetition times the arm and then the paired all-GPU model."""
    gen, pgen = generator(m, s.prompt), generator(s.paired, s.prompt)
    runs: dict[int, list] = {1: [], s.args.tokens + 1: []}
    paired_runs: dict[int, list] = {1: [], s.args.tokens + 1: []}
    rebalanced: list[dict] = []  # what the rebalancer did in each repetition's long generate
    for _ in range(reps):
        for n in runs:
            sync(s.device)
            mgr.reset_stats()
            before = mgr.rebalancer_counts()
            t0 = time.perf_counter()
            gen(n)
            sync(s.device)
            elapsed = time.perf_counter() - t0
            st = mgr.stats()
            runs[n].append((elapsed, dict(st.bytes_moved) | {"_stall": st.stall_seconds}))
            if n > 1:
                rebalanced.append(mgr.rebalancer_change(before))
            graphs = st.graphs  # the last timed generate's decode graphs
            step_graphs = st.step_graphs  # ... and its whole-step graphs (tiers.step_graph)
        with s.routed(s.paired, name):
            for n in paired_runs:
                sync(s.device)
                t0 = time.perf_counter()
                pgen(n)
                sync(s.device)
                paired_runs[n].append(time.perf_counter() - t0)
    return {**decode_figures(runs, paired_runs, s.args.tokens), "graphs": graphs, "step_graphs": step_graphs, "rebalanced": rebalanced}


def decode_figures(runs: dict[int, list], paired_runs: dict[int, list[float]], tokens: int) -> dict:
    """Decode ms/token of the arm and of its pair from the medians of their short and long
    generates, the arm's bytes and stalls per decode token from the means; and each
    repetition's decode, the arm's and its pair's (how far the host's slow phases move single
    repetitions, which the medians hide), and what each moved per decode token by source (whether
    a slow repetition moved more)."""
    one, full = runs[1], runs[tokens + 1]
    decode_ms = (statistics.median(t for t, _ in full) - statistics.median(t for t, _ in one)) / tokens * 1e3
    paired_decode_ms = (statistics.median(paired_runs[tokens + 1]) - statistics.median(paired_runs[1])) / tokens * 1e3
    sources = {k for _, b in one + full for k in b}
    per_token = {k: max(0.0, (statistics.mean(b.get(k, 0) for _, b in full) - statistics.mean(b.get(k, 0) for _, b in one)) / tokens)
                 for k in sources}
    stall_ms = per_token.pop("_stall") * 1e3  # the compute stream's waits on copies, per decode token
    return {"decode_ms": decode_ms, "paired_decode_ms": paired_decode_ms, "moved": per_token, "stall_ms": stall_ms,
            "decode_ms_per_rep": [(f - o) / tokens * 1e3 for (o, _), (f, _) in zip(one, full)],
            "paired_decode_ms_per_rep": [(f - o) / tokens * 1e3 for o, f in zip(paired_runs[1], paired_runs[tokens + 1])],
            "bytes_moved_per_rep": [{k: (fb.get(k, 0) - ob.get(k, 0)) / tokens for k in sorted(sources - {"_stall"})}
                                    for (_, ob), (_, fb) in zip(one, full)]}


def interleaved(s: Setting, m, mgr: Manager, name: str) -> dict:
    """The arm and its paired all-GPU model decoding step by step in turn
    (``tools.measure.interleaved_decode``), and the bytes the arm moved over the timed steps."""
    n = s.args.interleave
    usage: list[list[dict]] = [[], []]
    with s.routed(s.paired, name):
        arm_s, pair_s = interleaved_decode([m, s.paired], s.prompt, n, s.device, on_start=mgr.reset_stats, usage=usage)
    moved = {k: v / n for k, v in mgr.stats().bytes_moved.items()}
    diffs = [(a - b) * 1e3 for a, b in zip(arm_s, pair_s)]
    block = s.args.rebalance_every if rebalances(name) and s.args.rebalance_every > 0 else INTERLEAVE_BLOCK
    return {"tokens": n, "block": block, "arm_ms_per_token": statistics.fmean(arm_s) * 1e3,
            "pair_ms_per_token": statistics.fmean(pair_s) * 1e3, "overhead_ms_per_token": statistics.fmean(diffs),
            "block_overhead_ms_per_token": statistics.median(block_means(diffs, block)), "bytes_moved_per_token": moved,
            "arm_step_ms": [round(t * 1e3, 3) for t in arm_s], "pair_step_ms": [round(t * 1e3, 3) for t in pair_s],
            "arm_usage": step_usage(usage[0]), "pair_usage": step_usage(usage[1])}


def counted_run(s: Setting, m, mgr: Manager):
    """One more decode of 1 + T tokens, its lookups recorded: the arm's ``TierStats`` over it, and
    the hits of its cache policy and of the whole GPU tier against Belady's MIN on those lookups."""
    mgr.reset_stats()
    with mgr.recording() as trace:
        generator(m, s.prompt)(s.args.tokens + 1)
        sync(s.device)
        st = tiers.stats(m)
    # the whole GPU tier (hot set, rebalancer and cache) against MIN over as many slots, on the
    # lookups of the counted run
    all_slots = st.gpu_slots["hot"] + st.gpu_slots["staging"]
    return st, {"cache_hits_vs_belady": mgr.cache_vs_belady(trace, st.gpu_slots["staging"]),
                "gpu_hits_vs_belady": [st.hits["gpu"], belady(trace, all_slots), len(trace)]}


def prefill(s: Setting, m, mgr: Manager, name: str, arm_reps: int, resident: int) -> dict:
    """The arm's prefill: its peak GPU memory, then timed prefills alternating with the paired
    model's, each noted (``PrefillNotes``), the bytes they moved, and ``--prefill-marks`` more."""
    out: dict = {}
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    mgr.reset_stats()
    with torch.no_grad():  # the arm's prefill warm-up, alone: its peak GPU memory
        m(s.prefill_ids)
        sync(s.device)
    if s.device.type == "cuda":
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(s.device) - resident
    # prefill as decode: each repetition times the arm and then the paired model, after one
    # such alternation untimed: the warm-up above only warms the whole-layer graphs up, the
    # next prefill captures them (the first timed prefill was 7-44 ms slower than the next in
    # every arm of bench-qwen3_moe-run42.json, with the rebalancer or without)
    prefill_reps = max(PREFILL_REPS_MIN, arm_reps - 1)
    out["prefill_reps"] = prefill_reps
    with s.routed(s.paired, name):
        with torch.no_grad():
            s.paired(s.prefill_ids)
            sync(s.device)
        noted = PrefillNotes(m, mgr, s.prefill_ids)
        arm_prefill, pair_prefill = noted, (lambda: s.paired(s.prefill_ids))
        out["prefill_warm_s"] = [t for ts in paired_timings(arm_prefill, pair_prefill, s.device, 1) for t in ts]
        mgr.reset_stats()  # the timed prefills' bytes only: the warm-ups' whole-layer reads follow no earlier call
        noted.rows.clear()
        arm_s, pair_s = paired_timings(arm_prefill, pair_prefill, s.device, prefill_reps)
    out["prefill_notes"] = noted.rows
    out["prefill_s"], out["paired_prefill_s"] = statistics.median(arm_s), statistics.median(pair_s)
    # each timed prefill, the arm's and its pair's, in the order they ran: how far a run's
    # slow ones lie from the median (one arm's prefill moved 78-87 ms between runs)
    out["prefill_s_per_rep"], out["paired_prefill_s_per_rep"] = arm_s, pair_s
    ps = mgr.stats()
    out["prefill_bytes_moved"] = sum(ps.bytes_moved.values()) / prefill_reps
    # what whole-layer calls read without a row routed to it (counted in the bytes moved)
    out["prefill_unused_bytes"] = ps.streamed.get("unused_bytes", 0) / prefill_reps
    out["prefill_whole_calls"] = ps.streamed.get("whole", 0) / prefill_reps
    out["prefill_graphs"] = ps.whole_graphs  # whole-layer calls' plans and windows over the timed prefills
    if s.args.prefill_marks:  # after the timed prefills: where each marked one's time goes (tools.timeline)
        out["prefill_marks"] = [mgr.marked_prefill(m, s.prefill_ids) for _ in range(s.args.prefill_marks)]
    return out
