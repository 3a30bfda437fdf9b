"""The Markdown report of a bench result: the arms' table and the tables of what each arm recorded.

``markdown`` takes a result whose derived figures are in (``tools.bench_bounds.add_bounds``); each
table is left out where no arm recorded its fields, so a partial or an older run's JSON reads too.
"""
from __future__ import annotations

import collections
import json
import statistics

from tiers.tools.bench_bounds import OFFLOAD_TARGETS

MIB = 2**20


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

def attention_warmup_lines(w: dict | None) -> list[str]:
    """The Markdown's note of the attention warm-up (none for runs without it)."""
    if not w:
        return []
    return [f"Attention warmed before any arm: the all-GPU model generated {w['tokens']} tokens twice, in {w['first_s']:.2f} s "
            f"and then {w['second_s']:.2f} s (cuDNN among torch's attention backends: {w['cudnn_sdp']}).", ""]

def header(r: dict) -> list[str]:
    """The title, the command, the run's sizes and routing, and the arms' table's head."""
    return [f"# Bench: {r['model']} ({r['shape']['layers']} layers) on {r['device']}", "",
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
            "| H2D GB/s | GPU hit rate | GPU hits / Belady | peak GPU GiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def arms_table(r: dict) -> list[str]:
    """A row per arm: decode, its bounds, prefill, bytes moved, hit rates, peak memory."""
    lines = []
    for name, a in r["arms"].items():
        if "error" in a:
            lines.append(f"| {name} | error: {a['error']} |" + " |" * 11)
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
            f"{moved.get('cpu', 0) / MIB:.1f}, {moved.get('nvme', 0) / MIB:.1f}, {moved.get('rebalance', 0) / MIB:.1f}" if moved else "-",
            f"{a['h2d_gbps']:.1f}" if "h2d_gbps" in a else "-",
            f"{a['gpu_hit_rate']:.2f}" if "gpu_hit_rate" in a else "-",
            f"{vs[0] / vs[1]:.2f} ({vs[0]}/{vs[1]})" if vs and vs[1] else "-",
            f"{a['gpu_peak_bytes'] / 2**30:.1f}" if "gpu_peak_bytes" in a else "-",
        ]) + " |")
    return lines


def rep_overheads(r: dict) -> list[str]:
    """The decode overhead per repetition of each arm that has one."""
    lines = []
    reps = [(name, a) for name, a in r["arms"].items() if a.get("rep_overhead_ms_per_token") is not None]
    if reps:
        lines += ["", "Decode overhead per repetition: the median over repetitions of the arm's ms/token less its paired all-GPU "
                  "model's in the same repetition, and that over the bytes bound:", "",
                  "| arm | overhead ms/token | over bytes bound |", "|---|---|---|"]
        lines += [f"| {name} | {a['rep_overhead_ms_per_token']:.2f} | "
                  + ("-" if a.get("rep_overhead_over_bytes_bound") is None else f"{a['rep_overhead_over_bytes_bound']:.2f}") + " |"
                  for name, a in reps]
    return lines


def interleaved(r: dict) -> list[str]:
    """The interleaved decode's figures per arm, and the host's speed over those steps."""
    lines = []
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
                         f"| {sum(il['bytes_moved_per_token'].values()) / MIB:.1f} | {over(il.get('bound_ms'))} "
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
    return lines


def prefill_notes(r: dict) -> list[str]:
    """Each timed prefill of each Tiers arm that noted them."""
    lines = []
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
    return lines


def host_syncs(r: dict) -> list[str]:
    """The synchronizing calls in each marked prefill, where any were recorded."""
    lines = []
    synced = [(name, [m.get("host_syncs") for m in a.get("prefill_marks", ())]) for name, a in r["arms"].items()]
    synced = [(name, marks) for name, marks in synced if any(marks)]
    if synced:
        lines += ["", "Synchronizing calls in each marked prefill's forward (torch's sync debug mode), where the library made them:", ""]
        for name, marks in synced:
            for i, sites in enumerate(marks):
                counts = collections.Counter(sites or ())
                lines.append(f"- {name}, marked prefill {i + 1}: " + ("; ".join(f"{s} x{n}" for s, n in counts.items()) or "none"))
    return lines


def offload(r: dict) -> list[str]:
    """The offload table (``bench_bounds.offload_overheads``), where the run has one."""
    lines = []
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
    return lines


POLICIES = ("lru", "lfu", "forecast", "markov")  # the policies a run may have replayed (runs before this version: all four)


def cache_replay(r: dict) -> list[str]:
    """The cache policy (policies, in older runs) against Belady's MIN on the synthetic traces."""
    rows = r.get("cache_replay") or {}
    if not rows:
        return []
    policies = [p for p in POLICIES if any(p in row for row in rows.values())]
    lines = ["", "Cache policy alone against Belady's MIN on synthetic traces (capacity 25% of experts, no pinned set):", "",
             "| trace | lookups | belady | " + " | ".join(policies) + " | " + " | ".join(f"{p} / belady" for p in policies) + " |",
             "|---|---|---|" + "---|" * (2 * len(policies))]
    for label, row in rows.items():
        cells = [f"{row[p]:.3f}" if p in row else "-" for p in policies]
        ratios = [f"{row[p] / row['belady']:.3f}" if p in row else "-" for p in policies]
        lines.append(f"| {label} {row['trace']} | {row['lookups']} | {row['belady']:.3f} | " + " | ".join(cells + ratios) + " |")
    return lines


def copy_sweep_and_cold_read(r: dict) -> list[str]:
    """The H2D copy sweep and the cold reads, where the run measured them."""
    lines = []
    if r.get("copy_sweep"):
        lines += ["", "H2D from pinned memory, one stream: back-to-back copies of one size against one copy of the same bytes:", "",
                  "| copy MiB | copies | separate GB/s | one copy GB/s |", "|---|---|---|---|"]
        for row in r["copy_sweep"]:
            lines.append(f"| {row['size'] / MIB:.2f} | {row['copies']} | {row['separate_gbps']:.1f} | {row['one_copy_gbps']:.1f} |")
    if r.get("cold_read"):
        lines += ["", "Cold reads (page cache dropped) against O_DIRECT, same blobs, same run:", "", "```",
                  json.dumps(r["cold_read"], indent=1), "```"]
    return lines


SECTIONS = (header, arms_table, rep_overheads, interleaved, prefill_notes, host_syncs, offload, cache_replay,
            copy_sweep_and_cold_read)


def markdown(r: dict) -> str:
    """The report of result ``r``, its derived figures already in it."""
    return "\n".join(line for section in SECTIONS for line in section(r)) + "\n"
