"""bench/prefill_split.py: its config specs, and a run end to end on the CPU (its marks' arithmetic: tests/tools/test_timeline.py)."""
from __future__ import annotations

import math

import pytest

from bench_script import load

prefill_split = load("prefill_split")


def test_specs_default_their_optional_fields_and_refuse_unknown_choices():
    got = prefill_split.parse_spec("int8:auto:0:0.5")
    assert got == {"precision": "int8", "staging": "auto", "depth": "0", "fraction": 0.5, "whole": "auto", "buffers": None,
                   "plan": "copy", "dequant": "kernel", "route": "uniform", "graphs": "auto",
                   "copies": "batch"}
    got = prefill_split.parse_spec("bf16:24:1:0.25:on:3:compute:torch:rebal-frozen:on:each")
    assert (got["buffers"], got["plan"], got["dequant"], got["route"], got["graphs"], got["copies"]) == (
        3, "compute", "torch", "rebal-frozen", "on", "each")
    for bad, word in (("int8:auto:0:0.5:auto::copy:kernel:zipf", "route"), ("int8:auto:0:0.5:maybe", "whole"),
                      ("int8:auto:0", "fields"), ("int8:auto:0:0.5:auto::copy:kernel:skewed:x", "graphs"),
                      ("int8:auto:0:0.5:auto::copy:kernel:skewed:on:x", "copies"),
                      ("int8:auto:0:0.5:auto::copy:kernel:skewed:on:each:x", "fields")):
        with pytest.raises(SystemExit) as refused:
            prefill_split.parse_spec(bad)
        assert word in str(refused.value) and bad in str(refused.value)


def test_a_frozen_rebalancer_moves_nothing_while_timed(tmp_path, monkeypatch):
    """End to end on the CPU (tiny shapes): the rebalancer promotes experts while its config warms
    up; frozen, it lands every read before timing and moves nothing after, where the live one
    keeps rebalancing; skewed configs report their layouts."""
    import json
    import sys

    out = tmp_path / "split.json"
    live, frozen = "int8:auto:0:0.5:auto::copy:kernel:rebal", "int8:auto:0:0.5:auto::copy:kernel:rebal-frozen:on"
    monkeypatch.setattr(sys, "argv", ["prefill_split", "--layers", "3", "--prefill", "256", "--reps", "2", "--warm-generates", "2",
                                      "--configs", f"{live},{frozen}", "--out", str(out)])
    assert prefill_split.main() == 0
    got = json.loads(out.read_text())["configs"]
    for spec in (live, frozen):
        assert set(got[spec]["layout"]) >= {"load", "timed", "end"}
        assert got[spec]["rebalancer"]["promoted_hot"] > 0  # the warm-up's generates moved hot experts
        assert got[spec]["config"]["tiers"]["rebalance"] == {"every_tokens": 8}
    assert got[frozen]["layout"]["timed"] == got[frozen]["layout"]["end"]
    assert got[frozen]["rebalancer"]["in_flight"] == 0
    assert got[live]["rebalancer"]["rebalances"] > got[frozen]["rebalancer"]["rebalances"]
    assert got[live]["whole_graphs"]["on"] == 0 and got[frozen]["whole_graphs"]["on"] == 1  # auto (off on the CPU), on
    assert got[frozen]["whole_graphs"]["failed"] == 0
    kernels = json.loads(out.read_text())["all_gpu"]["kernels"]
    assert kernels["experts_calls"] == 3
    for spec in (live, frozen):
        med = got[spec]["median"]
        assert med["dependency_bound_s"] == prefill_split.dependency_bound_s(kernels, med["moved_bytes"])
        assert med["over_dependency_bound"] == med["prefill_s"] / med["dependency_bound_s"]


def test_kernel_split_adds_up_and_bounds_a_waiting_prefill():
    """On the CPU (tiny shapes): the untiered model's op time splits into its experts calls, one per
    layer, and the rest; the dependency bound is the rest plus the bytes at 55 GB/s."""
    import torch

    from tiers.tools.measure import TINY, build

    model = build("qwen3_moe", TINY["qwen3_moe"] | {"layers": 3}, torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    got = prefill_split.kernel_split(model, ids, cuda=False)
    assert got["experts_calls"] == 3
    assert 0 < got["experts_kernel_ms"] < got["kernel_ms"]
    assert math.isclose(got["other_kernel_ms"], got["kernel_ms"] - got["experts_kernel_ms"])
    # the hooks are gone: a second forward sees no ranges
    assert all(not m.mlp.experts._forward_pre_hooks and not m.mlp.experts._forward_hooks for m in model.model.layers)
    assert math.isclose(prefill_split.dependency_bound_s({"other_kernel_ms": 12.0}, 55e9 * 0.5), 0.512)
