"""The benchmark harness on tiny shapes (CPU): structure, bound arithmetic, and a fair lazy baseline.

The bound arithmetic and the report on hand-made results (no run) are in tests/tools/test_bench_bounds.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import time

import pytest
import torch

from tiers.tools import bench, bench_bounds, bench_report, bench_run, bench_runtime, bench_tiers, measure


def test_tiny_bench_runs_and_reports(tmp_path):
    rc = bench.main(["--tiny", "--tokens", "2", "--prefill", "16", "--reps", "1", "--device", "cpu",
                     "--interleave", "16", "--arms", "all_gpu,lazy,tiers_100_bf16,tiers_25_int8,tiers_0_int8", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--graphs", "sometimes", "--out", str(tmp_path)])
    assert set(r["arms"]) == {"all_gpu", "lazy", "tiers_100_bf16", "tiers_25_int8", "tiers_0_int8", "all_gpu/end"}
    assert r["arms"]["tiers_0_int8"]["residency"]["gpu"]["experts"] == 0  # staging slots only, like the lazy arm
    assert not (tmp_path / "bench-mixtral.partial.json").exists()
    # the all-GPU arm, measured at the start and again at the end: Tiers arms are held against the faster
    base = min(r["arms"]["all_gpu"]["decode_ms_per_token"], r["arms"]["all_gpu/end"]["decode_ms_per_token"])
    t = r["arms"]["tiers_25_int8"]
    moved = sum(t["bytes_moved_per_token"].values())
    assert moved > 0 and t["gpu_hit_rate"] < 1.0
    assert t["bound_ms_per_token"] == pytest.approx(base + moved / bench_bounds.H2D_BYTES_PER_S * 1e3)
    assert r["arms"]["tiers_100_bf16"]["gpu_hit_rate"] == 1.0
    # the static arm is timed over more repetitions than asked: it differs from all-GPU by less than the drift
    assert r["arms"]["tiers_100_bf16"]["reps"] == bench_tiers.STATIC_ARM_REPS and t["reps"] == 1
    # prefill is timed at least PREFILL_REPS_MIN times whatever --reps says (one decode repetition here)
    assert t["prefill_reps"] == bench_tiers.PREFILL_REPS_MIN == 3 and r["arms"]["tiers_100_bf16"]["prefill_reps"] == bench_tiers.STATIC_ARM_REPS - 1
    for name in ("tiers_100_bf16", "tiers_25_int8", "tiers_0_int8"):  # each paired with an all-GPU measurement, interleaved
        a = r["arms"][name]
        # a difference of medians over 2 tokens: measured, but on a busy CPU it can come out below 0
        assert math.isfinite(a["paired_all_gpu_ms_per_token"])
        assert a["over_paired_all_gpu"] == pytest.approx(a["decode_ms_per_token"] / a["paired_all_gpu_ms_per_token"])
    assert t["paired_overhead_over_bytes_bound"] == pytest.approx(
        (t["decode_ms_per_token"] - t["paired_all_gpu_ms_per_token"]) / (moved / bench_bounds.H2D_BYTES_PER_S * 1e3))
    replay_hits, optimum = t["cache_hits_vs_belady"]
    assert replay_hits <= optimum
    for row in r["cache_replay"].values():
        assert row["markov"] <= row["belady"]
    # the interleaved decode: 16 timed steps of the arm and of its pair, in 2 blocks of 8, and the bytes of those steps
    il = t["interleaved"]
    assert il["tokens"] == 16 and il["block"] == bench_tiers.INTERLEAVE_BLOCK and len(il["arm_step_ms"]) == len(il["pair_step_ms"]) == 16
    diffs = [a - b for a, b in zip(il["arm_step_ms"], il["pair_step_ms"])]
    assert il["overhead_ms_per_token"] == pytest.approx(statistics.fmean(diffs), abs=1e-3)
    assert il["block_overhead_ms_per_token"] == pytest.approx(statistics.fmean(diffs), abs=1e-3)  # the median of 2 is their mean
    il_moved = sum(il["bytes_moved_per_token"].values())
    assert il_moved > 0 and il["bound_ms"] == pytest.approx(il_moved / bench_bounds.H2D_BYTES_PER_S * 1e3)
    assert il["overhead_over_bytes_bound"] == pytest.approx(il["overhead_ms_per_token"] / il["bound_ms"])
    assert r["arms"]["tiers_100_bf16"]["interleaved"]["overhead_over_bytes_bound"] is None  # nothing moved: no ratio
    md = (tmp_path / "bench-mixtral-tiny.md").read_text()
    assert "| tiers_25_int8 |" in md and "Decode overhead per repetition" in md and "Decode interleaved step by step" in md
    # the plot beside the Markdown, where matplotlib (the bench extra) is installed
    assert (tmp_path / "bench-mixtral-tiny.png").is_file() == (importlib.util.find_spec("matplotlib") is not None)
    # each timed step's host work, the arm's and the pair's; the pair's fastest and slowest block in the Markdown
    for u in (il["arm_usage"], il["pair_usage"]):
        assert set(u) == {"host_ms", "cpu_ms", "sys_ms", "faults", "preempted"} and all(len(v) == 16 for v in u.values())
        assert all(0 < h <= s for h, s in zip(u["host_ms"], il["pair_step_ms"] if u is il["pair_usage"] else il["arm_step_ms"]))
    phases = bench_report.phase_usage(il["pair_usage"], il["block"])
    row = next(line for line in md.splitlines() if line.startswith("| tiers_25_int8 | ") and "| preempted" not in line
               and line.count("|") == 6 and ", " in line)
    assert row.split("|")[2].strip() == f"{phases['fastest']['host_ms']:.2f}, {phases['fastest']['cpu_ms']:.2f}"
    assert t["config"]["tiers"]["gpu"]["graphs"] is True and "decode_graphs" in t  # the YAML default, and the arm's counts
    assert t["prefill_graphs"]["on"] == 0 and set(t["prefill_graphs"]) >= {"captured", "replayed", "failed"}  # off without CUDA


def test_graphs_flag_reaches_the_tiers_arms(tmp_path):
    rc = bench.main(["--tiny", "--tokens", "2", "--prefill", "16", "--reps", "1", "--device", "cpu", "--warmup-tokens", "2",
                     "--interleave", "0", "--no-attention-warmup", "--arms", "tiers_25_int8", "--graphs", "off", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())
    assert r["arms"]["tiers_25_int8"]["config"]["tiers"]["gpu"]["graphs"] is False


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])  # gpt_oss: weights [in, out], biases
def test_lazy_arm_computes_what_eager_computes(model_type):
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    if model_type == "mixtral":
        model = measure.build("mixtral", dict(measure.TINY["mixtral"]), torch.device("cpu"))
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16)
    model.set_experts_implementation("eager")
    _, mod = next(iter(measure.expert_modules(model).values()))
    with torch.no_grad():
        for p in mod.parameters():  # biases too (initialized to zeros)
            p.normal_(0.0, 0.08)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, mod.down_proj.shape[-1 if mod.is_transposed else -2], generator=g).bfloat16()
    idx = torch.stack([torch.randperm(mod.num_experts, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g).bfloat16()
    with torch.no_grad():
        want = mod(x, idx, w)
        mod._lazy = {"gate_up_proj": mod.gate_up_proj.detach(), "down_proj": mod.down_proj.detach()}
        got = measure.lazy_experts_forward(mod, x, idx, w)
    assert torch.equal(want, got)


def test_skewed_arms_route_by_the_trace_and_rebalance(tmp_path):
    rc = bench.main(["--tiny", "--tokens", "4", "--prefill", "16", "--reps", "1", "--device", "cpu", "--rebalance-every", "2",
                     "--prefill-marks", "2", "--interleave", "0", "--no-attention-warmup",
                     "--arms", "all_gpu,all_gpu@skewed,tiers_25_int8@skewed,tiers_25_int8@skewed_norebal", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())
    t = r["arms"]["tiers_25_int8@skewed"]
    hits, optimum, lookups = t["gpu_hits_vs_belady"]
    assert 0 < hits <= optimum <= lookups
    assert t["rebalance"]["rebalances"] > 0
    # what the rebalancer did in the timed repetition: its counters' change over that generate
    (rep,) = t["rebalance_per_rep"]
    assert set(rep) == {"rebalances", "promoted_hot", "promoted_warm", "read_errors"}  # in_flight is a state, not a count
    # one 5-token generate, rebalancing every 2 tokens: at most 5 // 2 + 1 rounds (the prompt's forward
    # may close one), none of the warm-up's or earlier repetitions' rounds
    assert 0 < rep["rebalances"] <= 5 // 2 + 1 < t["rebalance"]["rebalances"]
    assert t["rebalance_warmup_promoted_hot"] == []  # no --rebalance-warmup
    off = r["arms"]["tiers_25_int8@skewed_norebal"]
    assert off["rebalance"] == {} and off["config"]["tiers"]["rebalance"]["every_tokens"] == 0
    # each timed prefill's notes, the warm-up's left out: what it queued adds up to what the arm moved
    for arm in (t, off):
        notes = arm["prefill_notes"]
        assert len(notes) == arm["prefill_reps"] == len(arm["prefill_s_per_rep"])
        assert all(0 < n["host_s"] for n in notes)
        assert all(0 < n["host_cpu_s"] <= n["host_s"] + 0.01 and n["others_cpu_s"] >= 0 for n in notes)
        assert all(n["graphs_captured"] == n["graphs_eager"] == n["graphs_replayed"] == 0 for n in notes)  # no graphs on the CPU
    assert sum(n["queued_bytes"] for n in off["prefill_notes"]) == pytest.approx(off["prefill_bytes_moved"] * off["prefill_reps"])
    assert sum(n["queued_bytes"] for n in off["prefill_notes"]) > 0
    assert sum(n["rebalancer"]["rebalances"] for n in t["prefill_notes"]) >= 1 and off["prefill_notes"][0]["rebalancer"] == {}
    md = (tmp_path / "bench-mixtral-tiny.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| tiers_25_int8@skewed_norebal | ") and "(0)" in line)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == ", ".join(f"{x * 1e3:.1f}" for x in off["prefill_s_per_rep"])
    assert cells[2] == ", ".join(f"{x * 1e3:.1f}" for x in off["paired_prefill_s_per_rep"])
    assert cells[4] == ", ".join(f"{n['host_cpu_s'] * 1e3:.1f}" for n in off["prefill_notes"])
    assert cells[6] == ", ".join(["0 (0)"] * off["prefill_reps"]) and cells[7] == ", ".join(["-"] * off["prefill_reps"])
    skewed = [r["arms"]["all_gpu@skewed"], r["arms"]["all_gpu@skewed/end"]]
    base = min(a["decode_ms_per_token"] for a in skewed)  # the bound of a skewed arm uses the skewed baseline
    assert off["bound_ms_per_token"] >= base
    assert t["bound_ms_per_token"] == pytest.approx(base + sum(t["bytes_moved_per_token"].values()) / bench_bounds.H2D_BYTES_PER_S * 1e3)
    assert t["prefill_bound_s"] >= min(a["prefill_s"] for a in skewed)
    # prefill against the all-GPU prefill interleaved with the arm's, under the same routing
    for arm in (t, off):
        assert arm["paired_prefill_s"] > 0
        assert arm["paired_prefill_bound_s"] == max(arm["paired_prefill_s"], arm["prefill_bytes_moved"] / bench_bounds.H2D_BYTES_PER_S)
        assert arm["prefill_over_paired_bound"] == pytest.approx(arm["prefill_s"] / arm["paired_prefill_bound_s"])
    assert r["routing"]["skewed"]["zipf_s"] == 1.2
    # --prefill-marks 2: two marked prefills per Tiers arm after the timed ones, with what the rebalancer did in each
    for arm, rebalancing in ((t, True), (off, False)):
        marks = arm["prefill_marks"]
        assert len(marks) == 2 and all(x["prefill_ms"] > 0 and x["moved_bytes"] > 0 for x in marks)
        assert all(len(x["layers"]) == 6 and x["total"]["host_ms"] > 0 for x in marks)
        assert all(x["host_syncs"] == [] for x in marks)  # sync debug mode is CUDA's: none recorded on the CPU
        assert all(set(x["rebalancer"]) == ({"rebalances", "promoted_hot", "promoted_warm", "read_errors"} if rebalancing else set()) for x in marks)
    assert "prefill_marks" not in r["arms"]["all_gpu@skewed"]
    assert "tiers_25_int8@skewed" in (tmp_path / "bench-mixtral-tiny.md").read_text()


def _spy_generates(monkeypatch) -> list[tuple[str, int | None]]:
    """Every ``generate`` from here on, in order: ("tiers" or "gpu", its max_new_tokens)."""
    from transformers import GenerationMixin

    from tiers.api import _MANAGER_ATTR

    calls = []
    generate = GenerationMixin.generate

    def spy(self, *a, **k):
        calls.append(("tiers" if hasattr(self, _MANAGER_ATTR) else "gpu", k.get("max_new_tokens")))
        return generate(self, *a, **k)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    return calls


def test_tiers_arm_repetitions_interleave_with_the_paired_all_gpu_model(tmp_path, monkeypatch):
    """Each repetition times the Tiers arm, then the paired all-GPU model: a host whose speed drifts
    within seconds moves both, where one block after the other would not."""
    calls = _spy_generates(monkeypatch)
    tokens = 2
    rc = bench.main(["--tiny", "--tokens", str(tokens), "--prefill", "16", "--reps", "2", "--device", "cpu", "--warmup-tokens", "5",
                     "--interleave", "0", "--arms", "tiers_25_int8", "--out", str(tmp_path)])
    assert rc == 0
    timed = [c for c in calls if c[1] in (1, tokens + 1)]
    rep = [("tiers", 1), ("tiers", tokens + 1), ("gpu", 1), ("gpu", tokens + 1)]
    start = next(i for i in range(len(timed)) if timed[i : i + 4] == rep)
    assert timed[start : start + 8] == rep * 2, timed
    a = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())["arms"]["tiers_25_int8"]
    assert a["paired_all_gpu_ms_per_token"] > 0
    # each repetition's decode; over two repetitions the medians are means, so they agree
    assert len(a["decode_ms_per_rep"]) == len(a["paired_decode_ms_per_rep"]) == 2
    assert statistics.mean(a["decode_ms_per_rep"]) == pytest.approx(a["decode_ms_per_token"])
    assert statistics.mean(a["paired_decode_ms_per_rep"]) == pytest.approx(a["paired_all_gpu_ms_per_token"])
    # and each repetition's bytes, whose mean is the arm's bytes per token
    per_rep = a["bytes_moved_per_rep"]
    assert len(per_rep) == 2 and set(per_rep[0]) == set(a["bytes_moved_per_token"])
    for k, v in a["bytes_moved_per_token"].items():
        assert max(0.0, statistics.mean(r[k] for r in per_rep)) == pytest.approx(v)
    assert sum(a["bytes_moved_per_token"].values()) > 0
    assert "rebalance_per_rep" not in a  # no rebalancer in this arm


def test_paired_timings_alternate_the_arm_and_its_pair():
    calls = []
    arm, pair = bench_tiers.paired_timings(lambda: calls.append("arm"), lambda: calls.append("pair"), torch.device("cpu"), 3)
    assert calls == ["arm", "pair"] * 3 and len(arm) == len(pair) == 3 and min(arm + pair) >= 0
    r = bench_bounds.add_bounds({"arms": {"all_gpu": {"decode_ms_per_token": 10.0, "prefill_s": 0.02},
                                   "tiers_25_int8": {"decode_ms_per_token": 12.0, "bytes_moved_per_token": {"cpu": 55e6},
                                                     "prefill_s": 0.06, "paired_prefill_s": 0.03, "prefill_bytes_moved": 1.1e9}}})
    t = r["arms"]["tiers_25_int8"]
    assert t["prefill_bound_s"] == pytest.approx(0.02) and t["paired_prefill_bound_s"] == pytest.approx(0.03)
    assert t["prefill_over_bound"] == pytest.approx(3.0) and t["prefill_over_paired_bound"] == pytest.approx(2.0)


def test_bad_cold_read_rounds_are_refused_before_any_arm_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("the bench ran with a bad --cold-read-rounds"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", "--device", "cpu", "--cold-read-gb", "0.01", "--cold-read-rounds", "0", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--cold-read-rounds" in capsys.readouterr().err
    # the interleaved decode needs one whole block (one rebalance interval where that is longer)
    for bad in (["--interleave", "-1"], ["--interleave", "7"], ["--interleave", "12", "--rebalance-every", "16"]):
        with pytest.raises(SystemExit) as e:
            bench.main(["--tiny", "--device", "cpu", *bad, "--out", str(tmp_path)])
        assert e.value.code == 2 and "--interleave" in capsys.readouterr().err, bad


def test_only_rebalancing_skewed_arms_get_the_rebalancer_warm_up(tmp_path, monkeypatch):
    """``--rebalance-warmup 150``: the skewed arm with the rebalancer generates 64 + 64 + 22 more
    tokens after its ordinary warm-up and before its first timed generate; the arm without the
    rebalancer and the all-GPU arms generate none of them. A negative count is refused."""
    assert bench_tiers.rebalance_warmup_generates(150) == [64, 64, 22] and bench_tiers.rebalance_warmup_generates(0) == []
    calls = _spy_generates(monkeypatch)
    for arm in ("tiers_25_int8@skewed", "tiers_25_int8@skewed_norebal"):
        calls.clear()
        rc = bench.main(["--tiny", "--tokens", "2", "--prefill", "16", "--reps", "1", "--device", "cpu", "--warmup-tokens", "5",
                         "--rebalance-every", "2", "--rebalance-warmup", "150", "--interleave", "0", "--no-attention-warmup",
                         "--arms", arm, "--out", str(tmp_path)])
        assert rc == 0
        tiers_calls = [n for who, n in calls if who == "tiers"]
        first_timed = tiers_calls.index(1)
        extra = tiers_calls[tiers_calls.index(5) + 1 : first_timed]
        assert extra == ([64, 64, 22] if arm.endswith("@skewed") else []), (arm, tiers_calls)
        row = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())["arms"][arm]
        if arm.endswith("@skewed"):  # hot promotions per warm-up generate, each a share of the arm's
            settling = row["rebalance_warmup_promoted_hot"]
            assert len(settling) == 3 and all(n >= 0 for n in settling)
            assert 0 < sum(settling) <= row["rebalance"]["promoted_hot"]
        else:
            assert "rebalance_warmup_promoted_hot" not in row
        assert 150 not in [n for who, n in calls if who == "gpu"] and 64 not in [n for who, n in calls if who == "gpu"]
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--rebalance-warmup", "-1", "--out", str(tmp_path)])


def test_attention_is_warmed_at_every_decoded_length_before_any_arm(tmp_path, monkeypatch):
    """Before any arm, the all-GPU model generates twice, one decode step at every KV length the
    run decodes at (here the interleaved steps' 16 + 8 untimed, the longest), both timed; off
    with ``--no-attention-warmup``."""
    calls = _spy_generates(monkeypatch)
    argv = ["--tiny", "--tokens", "2", "--prefill", "16", "--reps", "1", "--device", "cpu", "--warmup-tokens", "5", "--interleave", "16",
            "--arms", "all_gpu,tiers_25_int8", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    want = 16 + measure.INTERLEAVE_SKIP + 1
    assert calls[:3] == [("gpu", want), ("gpu", want), ("gpu", 5)], calls[:4]
    w = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())["attention_warmup"]
    assert w["tokens"] == want and w["first_s"] > 0 and w["second_s"] > 0 and w["cudnn_sdp"] is None  # no CUDA here
    assert f"generated {want} tokens twice" in (tmp_path / "bench-mixtral-tiny.md").read_text()
    calls.clear()
    assert bench.main(argv + ["--no-attention-warmup"]) == 0
    assert calls[0] == ("gpu", 5)
    assert "attention_warmup" not in json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())


def test_the_attention_warmup_covers_the_longest_decode():
    """Each of the run's decodes can be the longest: the warm-up takes the largest."""
    ns = argparse.Namespace(warmup_tokens=32, tokens=16, slow_tokens=2, rebalance_warmup=0, interleave=0)
    assert bench_run.attention_warmup_tokens(ns) == 32
    assert bench_run.attention_warmup_tokens(argparse.Namespace(**{**vars(ns), "tokens": 40})) == 41
    assert bench_run.attention_warmup_tokens(argparse.Namespace(**{**vars(ns), "slow_tokens": 50})) == 51
    assert bench_run.attention_warmup_tokens(argparse.Namespace(**{**vars(ns), "rebalance_warmup": 1})) == bench_tiers.REBALANCE_WARMUP_GENERATE
    assert bench_run.attention_warmup_tokens(argparse.Namespace(**{**vars(ns), "interleave": 192})) == 192 + measure.INTERLEAVE_SKIP + 1


def test_prefill_is_timed_at_least_prefill_reps_min_times(tmp_path, monkeypatch):
    """With --reps 1 (and 2) a single timed prefill was left to the host's slow phases: each Tiers
    arm times PREFILL_REPS_MIN prefills and its pair's, alternately, at least."""
    asked = []
    real = bench_tiers.paired_timings

    def spy(arm, pair, device, reps):
        asked.append(reps)
        return real(arm, pair, device, reps)

    monkeypatch.setattr(bench_tiers, "paired_timings", spy)
    rc = bench.main(["--tiny", "--tokens", "2", "--prefill", "16", "--reps", "1", "--device", "cpu", "--warmup-tokens", "2",
                     "--interleave", "0", "--arms", "tiers_25_int8", "--out", str(tmp_path)])
    assert rc == 0 and asked == [1, bench_tiers.PREFILL_REPS_MIN]  # the untimed alternation, then the timed ones
    row = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())["arms"]["tiers_25_int8"]
    assert row["prefill_reps"] == bench_tiers.PREFILL_REPS_MIN and "interleaved" not in row  # --interleave 0: none
    # every timed prefill is kept, the arm's and its pair's, and the medians are theirs
    assert len(row["prefill_s_per_rep"]) == len(row["paired_prefill_s_per_rep"]) == bench_tiers.PREFILL_REPS_MIN
    assert len(row["prefill_warm_s"]) == 2  # one untimed alternation, arm then pair
    assert row["prefill_s"] == statistics.median(row["prefill_s_per_rep"])
    assert row["paired_prefill_s"] == statistics.median(row["paired_prefill_s_per_rep"])


def test_prefill_notes_count_what_each_call_did():
    """``PrefillNotes`` takes each counter's change over one call, not its running total."""
    from types import SimpleNamespace

    graphs = SimpleNamespace(eager_calls=5, captured=7, replayed=100)
    rb = SimpleNamespace(counts={"rebalances": 3, "promoted_hot": 9})
    mgr = SimpleNamespace(prefill_graphs=graphs, rebalancer=rb, stats_=SimpleNamespace(bytes_moved={"cpu": 10, "nvme": 5}))
    calls = []

    def model(ids):  # a prefill that captures two graphs, replays 12, queues 40 bytes and rebalances once
        calls.append(ids)
        graphs.captured += 2
        graphs.replayed += 12
        mgr.stats_.bytes_moved["cpu"] += 40
        rb.counts["rebalances"] += 1
        if len(calls) == 2:
            rb.counts["promoted_hot"] += 4
    notes = bench_tiers.PrefillNotes(model, bench_runtime.Manager(mgr), "ids")
    notes()
    notes()
    assert calls == ["ids", "ids"]
    first, second = notes.rows
    assert first["graphs_captured"] == second["graphs_captured"] == 2 and first["graphs_replayed"] == 12
    assert first["graphs_eager"] == 0 and first["queued_bytes"] == second["queued_bytes"] == 40
    assert first["rebalancer"] == {"rebalances": 1, "promoted_hot": 0} and second["rebalancer"] == {"rebalances": 1, "promoted_hot": 4}
    assert all(n["host_s"] >= 0 for n in notes.rows)
    mgr.rebalancer = None
    notes()
    assert notes.rows[-1]["rebalancer"] == {}


def test_prefill_notes_tell_waiting_from_working_and_see_other_threads_work():
    """A forward that sleeps shows host time without the serving thread's CPU time; one whose
    other thread spins shows that thread's CPU time, not the serving thread's."""
    import threading
    from types import SimpleNamespace

    graphs = SimpleNamespace(eager_calls=0, captured=0, replayed=0)
    mgr = SimpleNamespace(prefill_graphs=graphs, rebalancer=None, stats_=SimpleNamespace(bytes_moved={}))

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def model(ids):
        if ids == "sleep":
            time.sleep(0.2)
        else:
            t = threading.Thread(target=spin, args=(0.2,))
            t.start()
            t.join()
    slept, spun = (bench_tiers.PrefillNotes(model, bench_runtime.Manager(mgr), ids) for ids in ("sleep", "spin"))
    slept()
    spun()
    (a,), (b,) = slept.rows, spun.rows
    assert a["host_s"] >= 0.2 and a["host_cpu_s"] < 0.05 and a["others_cpu_s"] < 0.05
    assert b["host_s"] >= 0.2 and b["host_cpu_s"] < 0.05 and b["others_cpu_s"] >= 0.15


def test_a_routed_arm_loads_what_its_skewed_arm_counted(tmp_path, monkeypatch):
    """``@skewed_routed``: loaded with the routing document its ``@skewed`` arm counted at its end,
    the rebalancer on, and no rebalancer warm-up before its timed repetitions."""
    import tiers as tiers_pkg

    loads = []
    load = tiers_pkg.load

    def spy(path, cfg, **kw):
        loads.append(kw.get("routing"))
        return load(path, cfg, **kw)

    monkeypatch.setattr(tiers_pkg, "load", spy)
    rc = bench.main(["--tiny", "--tokens", "2", "--prefill", "16", "--reps", "1", "--device", "cpu", "--warmup-tokens", "5",
                     "--rebalance-every", "2", "--rebalance-warmup", "64", "--interleave", "0", "--no-attention-warmup",
                     "--arms", "tiers_25_int8@skewed,tiers_25_int8@skewed_routed", "--out", str(tmp_path)])
    assert rc == 0
    assert len(loads) == 2 and loads[0] is None
    doc = loads[1]
    assert doc["format"] == "tiers-routing" and doc["tokens"] > 64  # the warm-up's tokens and more
    arms = json.loads((tmp_path / "bench-mixtral-tiny.json").read_text())["arms"]
    routed, skewed = arms["tiers_25_int8@skewed_routed"], arms["tiers_25_int8@skewed"]
    assert routed["routing_from"] == {"arm": "tiers_25_int8@skewed", "tokens": doc["tokens"]}
    assert "routing_from" not in skewed
    assert routed["config"]["tiers"]["rebalance"]["every_tokens"] == 2 and routed["rebalance"]["rebalances"] > 0
    assert routed["rebalance_warmup_promoted_hot"] == [] and len(skewed["rebalance_warmup_promoted_hot"]) == 1


@pytest.mark.parametrize("arms", ["tiers_25_int8@skewed_routed", "tiers_25_int8@skewed_routed,tiers_25_int8@skewed",
                                  "tiers_50_int8@skewed,tiers_25_int8@skewed_routed", "all_gpu@skewed,all_gpu@skewed_routed"])
def test_a_routed_arm_without_its_skewed_arm_before_it_is_refused(tmp_path, capsys, arms):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu", "--arms", arms, "--out", str(tmp_path)])
    assert "_routed" in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_the_staging_only_arm_holds_no_hot_expert_at_mixtral_shapes(packed_factory, precision):
    """The staging-slots arm's budget is exactly its slots and transit rows, also where the
    placement keeps a ring of two rows (Mixtral-8x7B's INT8 experts, above ``STACK_BYTES``): sized
    with a row per slot, it would hold one hot expert. Real shapes, layouts only (no weights)."""
    import dataclasses

    from tiers.loader.blob import blob_layout
    from tiers.loader.layout import ExpertLayout, ExpertTensor
    from tiers.loader.packed import read_manifest
    from tiers.config import parse_config
    from tiers.policy.placement import plan_placement

    tiny = read_manifest(packed_factory("mixtral"))
    layout = ExpertLayout(8, (ExpertTensor("gate_up_proj", (2 * 14336, 4096)), ExpertTensor("down_proj", (4096, 14336))))
    entry = next(iter(tiny.layers.values()))
    layers = {L: dataclasses.replace(entry, layer=L, layout=layout, blobs={p: blob_layout(layout, p) for p in tiny.precisions})
              for L in range(8)}
    manifest = dataclasses.replace(tiny, layers=layers)
    gpu = bench_runtime.staging_only_gpu(manifest, precision, 4)
    cfg = parse_config({"tiers": {"gpu": gpu, "cpu": {"fraction": 1.0, "precision": precision}, "nvme": {"precision": precision}}})
    p = plan_placement(cfg, manifest)
    assert p.hot == () and [(g.staging, g.transit_rows) for g in p.groups] == [(4, 2 if precision == "int8" else 4)]
    assert p.gpu_bytes == gpu["budget"]


def test_a_hot_arm_keeps_its_hot_experts_in_its_precision(tmp_path):
    """``tiers_30_int4_hot``: the gpu tier in int4 too (quantized hot experts); ``tiers_30_int4``
    keeps bf16 hot experts; both warm in int4, with a cpu budget of every expert's bytes."""
    from tiers.tools.bench_arms import arm_precisions, tiers_config

    args = argparse.Namespace(staging_slots="auto", graphs="on", rebalance_every=8)
    hot = tiers_config("tiers_30_int4_hot", args, 1 << 20, tmp_path, 8)["tiers"]
    plain = tiers_config("tiers_30_int4", args, 1 << 20, tmp_path, 8)["tiers"]
    assert hot["gpu"]["precision"] == "int4" and "precision" not in plain["gpu"]
    assert hot["gpu"]["fraction"] == plain["gpu"]["fraction"] == 0.3
    assert hot["cpu"] == plain["cpu"] == {"budget": 1 << 20, "precision": "int4"}
    assert arm_precisions(["tiers_30_int4_hot", "all_gpu"]) == ["bf16", "int8", "int4"]
