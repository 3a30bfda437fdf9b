"""Windows of the slabs for grouped GEMMs (tiers.paths.compute.windows): a partition of the rows, each slot at its offsets."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.paths import compute


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 300), st.integers(1, 5), min_size=1, max_size=40), st.integers(1, 20))
def test_windows_partition_the_rows_and_keep_every_slot_at_its_offset(slot_rows, gap):
    items = sorted(slot_rows.items())
    old, compute.WINDOW_GAP = compute.WINDOW_GAP, gap
    try:
        windows = compute.windows(items)
        runs = compute.slot_runs([s for s, _ in items])
    finally:
        compute.WINDOW_GAP = old
    assert runs == [(w["lo"], w["hi"]) for w in windows], "slot_runs splits used slots as windows does"
    row = 0
    for i, w in enumerate(windows):
        assert w["a"] == row and len(w["offs"]) == w["hi"] - w["lo"]
        assert all(x <= y for x, y in zip(w["offs"], w["offs"][1:])) and w["offs"][-1] == w["b"] - w["a"]
        inside = [(s, n) for s, n in items if w["lo"] <= s < w["hi"]]
        assert inside[0][0] == w["lo"] and inside[-1][0] == w["hi"] - 1
        assert all(t - s - 1 < gap for (s, _), (t, _) in zip(inside, inside[1:])), "a window spans a gap it should have closed at"
        for s, n in inside:  # each slot's rows sit at its offsets: end minus start is its count
            before = w["offs"][s - w["lo"] - 1] if s > w["lo"] else 0
            assert w["offs"][s - w["lo"]] - before == n
        if i:
            assert w["lo"] - windows[i - 1]["hi"] >= gap, "a window closed before a gap of WINDOW_GAP empty slots"
        row = w["b"]
    assert row == sum(slot_rows.values())
