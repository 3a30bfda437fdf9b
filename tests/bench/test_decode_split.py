"""bench/decode_split.py: a token's host time split from synthetic marks, and step timers that
leave their owners as they found them."""
from __future__ import annotations

import math

import torch

from bench_script import load

decode_split = load("decode_split")


def _token(t0: float, layers: int, attn: float, experts: float, post: float) -> list[tuple]:
    """Marks of one forward: per layer, ``attn`` ms before its experts call, ``experts`` ms in it,
    ``post`` ms after (host clock in seconds, no device events)."""
    marks, t = [], t0
    for i in range(layers):
        marks.append(("layer", i, t, None))
        t += attn / 1e3
        marks.append(("experts", i, t, None))
        t += experts / 1e3
        marks.append(("experts_end", i, t, None))
        t += post / 1e3
        marks.append(("layer_end", i, t, None))
    return marks


def test_split_adds_up_per_token_and_skips_the_prompt():
    clock = decode_split.Clock(torch.device("cpu"))
    layers, gap = 3, 2.0  # ms between a forward's last layer and the next forward (sampling, sync)
    t = 0.0
    for token in range(4):
        attn, experts, post = (50.0, 50.0, 50.0) if token == 0 else ((2.0, 3.0, 7.0)[token - 1], 0.5, 0.25)  # the prompt's forward is long
        clock.marks += _token(t, layers, attn, experts, post)
        t = clock.marks[-1][2] + gap / 1e3
    clock.marks.append(("layer", 0, t, None))  # the next token's start closes the last one
    got = clock.split(layers)
    assert got["tokens"] == 3  # tokens 1..3; the prompt's forward is left out
    # medians over tokens 1, 2, 3, whose attention parts take 2, 3 and 7 ms
    assert math.isclose(got["host_before_experts_ms"], layers * 3.0)
    assert math.isclose(got["host_experts_ms"], layers * 0.5)
    assert math.isclose(got["host_after_experts_ms"], layers * 0.25)
    assert math.isclose(got["host_forward_ms"], layers * (3.0 + 0.5 + 0.25))
    assert math.isclose(got["token_ms"], layers * (3.0 + 0.5 + 0.25) + gap)
    assert math.isclose(got["token_ms_mean"], layers * (4.0 + 0.5 + 0.25) + gap)  # the slow token counts in the mean
    assert math.isnan(got["device_token_ms"])


def test_arm_variants_are_read_and_unknown_ones_refused():
    assert decode_split.parse_arm("tiers_25_int8@skewed") == (25, "int8", False, frozenset(), "@skewed")
    assert decode_split.parse_arm("tiers_50_int8-nodirect~inline~gcoff@skewed_norebal") == (
        50, "int8", True, frozenset({"inline", "gcoff"}), "@skewed_norebal")
    assert decode_split.parse_arm("tiers_50_int8~nograph@skewed") == (50, "int8", False, frozenset({"nograph"}), "@skewed")
    assert decode_split.parse_arm("tiers_50_int8~omp1~idle@skewed") == (50, "int8", False, frozenset({"omp1", "idle"}), "@skewed")
    for bad, says in (("tiers_25_int8~fast@skewed", "unknown variant"), ("tiers_x_int8", "cannot read"),
                      ("tiers_25_int8~idle@skewed_norebal", "only @skewed arms"), ("tiers_25_int8~idle", "only @skewed arms")):
        try:
            decode_split.parse_arm(bad)
        except SystemExit as e:
            assert says in str(e) and bad in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_timed_conditions_set_and_restore_the_interpreter():
    import gc
    import sys

    switch = sys.getswitchinterval()
    assert gc.isenabled()
    with decode_split.timed_conditions({"gcoff", "switch"}):
        assert not gc.isenabled() and math.isclose(sys.getswitchinterval(), 5e-5)
    assert gc.isenabled() and sys.getswitchinterval() == switch
    with decode_split.timed_conditions(set()):
        assert gc.isenabled() and sys.getswitchinterval() == switch
    try:
        with decode_split.timed_conditions({"gcoff"}):
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled(), "an error left the collector off"


def test_top_functions_rank_by_own_time_per_token():
    import cProfile
    import time as _time

    def slow():
        t = _time.perf_counter()
        while _time.perf_counter() - t < 0.02:
            pass

    def fast():
        return sum(range(10))

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(4):
        slow()
        fast()
    prof.disable()
    top = decode_split.top_functions(prof, 3, per=2)
    assert len(top) == 3
    assert [r["own_ms"] for r in top] == sorted((r["own_ms"] for r in top), reverse=True)
    slow_row = next(r for r in top if "(slow)" in r["function"])
    assert slow_row["calls"] == 2.0  # 4 calls over 2 tokens
    assert slow_row["cum_ms"] >= 40.0 - 1.0  # 80 ms over 2 tokens, most of it under perf_counter


def test_omp1_holds_torch_at_one_thread_for_its_arm_alone(tmp_path, monkeypatch):
    """``~omp1``: the arm loads (and so starts its threads) and runs with one intra-op thread; the
    arms after it, and the caller, get the count back."""
    import json
    import sys

    import tiers

    seen = []
    real_load = tiers.load
    monkeypatch.setattr(tiers, "load", lambda *a, **k: (seen.append(torch.get_num_threads()), real_load(*a, **k))[1])
    before = torch.get_num_threads()
    out = tmp_path / "split.json"
    monkeypatch.setattr(sys, "argv", ["decode_split.py", "--layers", "2", "--tokens", "4", "--reps", "1",
                                      "--arms", "tiers_50_int8~omp1,tiers_50_int8", "--out", str(out)])
    assert decode_split.main() == 0
    assert seen == [1, before] and torch.get_num_threads() == before
    r = json.loads(out.read_text())
    assert set(r["arms"]) == {"tiers_50_int8~omp1", "tiers_50_int8"} and r["host"]["intra_op_threads"] == before
