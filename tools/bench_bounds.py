"""Figures derived from a bench run's measurements: each Tiers arm's bytes bounds and its overheads over them.

Also the offload table: each offloaded Tiers arm's largest decode overhead against accelerate's
and naive lazy's. Pure functions of the result dict, so ``--report`` derives them again from a
run's JSON.
"""
from __future__ import annotations

import statistics

H2D_BYTES_PER_S = 55e9  # measured pinned host-to-device ceiling on the H200 test machine
# The offload target: a Tiers arm's overhead per token at least this many times smaller than
# accelerate's and naive lazy's (all three above the faster all-GPU measurement of their routing)
OFFLOAD_TARGETS = {"accelerate": 50.0, "lazy": 10.0}


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


def interleaved_bounds(row: dict) -> None:
    """The interleaved decode's bytes bound (its own steps' bytes / 55 GB/s) and each overhead over it."""
    il = row.get("interleaved")
    if not il:
        return
    il["bound_ms"] = sum(il["bytes_moved_per_token"].values()) / H2D_BYTES_PER_S * 1e3
    for key in ("overhead", "block_overhead"):
        il[f"{key}_over_bytes_bound"] = il[f"{key}_ms_per_token"] / il["bound_ms"] if il["bound_ms"] else None


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
