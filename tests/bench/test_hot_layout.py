"""bench/hot_layout.py: per-layer hot counts and slot runs read from a residency table."""
from __future__ import annotations

from dataclasses import dataclass

from tiers.loader.layout import ExpertKey
from tiers.integration import WINDOW_GAP

from bench_script import load

hot_layout = load("hot_layout")


@dataclass
class _Row:
    pinned: bool
    slot: int | None
    host_offset: int | None = None


def test_layout_counts_hot_experts_and_splits_their_slots_at_gaps():
    table = {ExpertKey(L, e): _Row(False, None) for L in range(3) for e in range(4)}
    for e, slot in enumerate((0, 1, 2)):  # layer 0: three neighbouring slots, one run
        table[ExpertKey(0, e)] = _Row(True, slot)
    table[ExpertKey(1, 3)] = _Row(True, 3)  # layer 1: two slots a gap apart, two runs
    table[ExpertKey(1, 0)] = _Row(True, 3 + WINDOW_GAP + 1)
    table[ExpertKey(2, 1)] = _Row(False, 5)  # a staged (not hot) expert counts for nothing
    got = hot_layout.layout_summary(table, [0, 1, 2], 4)
    assert got == {"hot_per_layer": [3, 2, 0], "slot_runs_per_layer": [1, 2, 0]}


def test_layout_counts_runs_of_warm_places_lying_back_to_back():
    """With the place size: per layer, the warm experts' host places sorted, split where one
    does not start where the one before ends; hot experts have none."""
    table = {ExpertKey(L, e): _Row(True, L * 4 + e) for L in range(2) for e in range(4)}
    for e, off in enumerate((300, 100, 200)):  # layer 0: three places back to back, in any expert order
        table[ExpertKey(0, e)] = _Row(False, None, off)
    for e, off in ((0, 0), (2, 200)):  # layer 1: two places with a hole between them
        table[ExpertKey(1, e)] = _Row(False, None, off)
    got = hot_layout.layout_summary(table, [0, 1], 4, place=100)
    assert got["warm_place_runs_per_layer"] == [1, 2] and got["hot_per_layer"] == [1, 2]
    assert "warm_place_runs_per_layer" not in hot_layout.layout_summary(table, [0, 1], 4)


def test_prefill_counts_each_copy_and_dequantization_launch_once(packed_factory):
    """A forward whose long calls stream every warm expert: one copy per run of back-to-back
    blobs in each part, so at least one copy and no more than one per warm expert a part reads;
    each part dequantizes its runs of slots, at least one launch per tensor and part and at most
    one per tensor and warm expert; the manager and the scheme are left as they were."""
    import torch

    from tiers import quant
    import tiers
    from tiers.integration import manager_of

    cfg = {"tiers": {"gpu": {"fraction": 0.4, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "int8"},
                     "nvme": {"precision": "int8"}}}
    m = tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False)
    mgr = manager_of(m)
    ids = torch.randint(0, m.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    mgr.reset_stats()
    n = hot_layout.prefill_counts(m, ids)
    streamed = mgr.stats().streamed
    assert streamed["parts"] > 0 and streamed["parts"] <= n["copies"]  # every part read something here
    warm = sum(r.home.value == "cpu" for _, r in mgr.table.items())
    assert n["copies"] <= warm
    tensors = len(next(iter(mgr.manifest.layers.values())).blobs["int8"].shapes)
    assert tensors * streamed["parts"] <= n["dequantizations"] <= tensors * warm
    assert "_check_pinned" not in vars(mgr) and "dequantize" not in vars(quant.get_scheme("int8"))


def test_modes_run_each_fraction_with_own_layer_and_across_layer_moves(tmp_path, monkeypatch):
    """``--modes own,across``: a row per fraction and mode, each with its hit rate per four
    generates; own-layer moves keep every layer's hot count and one run of its hot slots."""
    import json
    import sys

    out = tmp_path / "layout.json"
    monkeypatch.setattr(sys, "argv", ["hot_layout.py", "--layers", "3", "--experts", "16", "--top-k", "4", "--fractions", "0.25",
                                      "--generates", "8", "--tokens", "9", "--every", "2", "--prefill", "0",
                                      "--modes", "own,across", "--out", str(out)])
    assert hot_layout.main() == 0
    rows = json.loads(out.read_text())["fractions"]
    assert sorted(rows) == ["0.25:across", "0.25:own"]
    for row in rows.values():
        assert len(row["gpu_hit_rate_per_4"]) == 2 and all(0 <= h <= 1 for h in row["gpu_hit_rate_per_4"])
        assert row["rebalancer"]["promoted_hot"] > 0
    own = rows["0.25:own"]
    assert own["after"]["hot_per_layer"] == own["load"]["hot_per_layer"] and set(own["after"]["slot_runs_per_layer"]) == {1}
