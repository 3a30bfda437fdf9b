"""ExpertGrid: experts as cells of one flat array, in key order (the rebalancer's ties depend on it)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.loader.layout import ExpertGrid, ExpertKey


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, 40), st.integers(1, 9), min_size=1, max_size=6))
def test_cells_follow_key_order_and_round_trip(experts):
    """Every expert has its own cell, the cells ascend as the keys do (layer, then expert), and
    ``key`` inverts ``index``; the cells past a layer's last expert belong to no expert."""
    grid = ExpertGrid(experts)
    keys = sorted(ExpertKey(L, e) for L, n in experts.items() for e in range(n))
    cells = [grid.index(k) for k in keys]
    assert cells == sorted(set(cells)) and all(0 <= c < grid.size for c in cells)
    assert [grid.key(c) for c in cells] == keys
    assert grid.size == len(experts) * max(experts.values())
    L = min(experts)
    with pytest.raises(KeyError, match=f"layer {L} expert {experts[L]}"):
        grid.index(ExpertKey(L, experts[L]))
    with pytest.raises(KeyError):
        grid.index(ExpertKey(41, 0))


def test_masks_counts_and_back():
    grid = ExpertGrid.of([ExpertKey(3, 1), ExpertKey(0, 2)])  # layers 0 and 3, three experts wide
    assert (grid.layers, grid.width, grid.size) == ([0, 3], 3, 6)
    assert grid.mask([ExpertKey(3, 1)]).tolist() == [False, False, False, False, True, False]
    assert grid.mask([]).sum() == 0
    counts = Counter({ExpertKey(0, 2): 5, ExpertKey(3, 0): 2, ExpertKey(7, 0): 9})  # layer 7 is outside: left out
    dense = grid.dense(counts)
    assert dense.dtype == np.int64 and dense.tolist() == [0, 0, 5, 2, 0, 0]
    assert grid.counter(dense) == Counter({ExpertKey(0, 2): 5, ExpertKey(3, 0): 2})
    assert grid.dense({ExpertKey(3, 1): 0.5, ExpertKey(3, 2): 7}, np.float64).tolist() == [0, 0, 0, 0, 0.5, 0]  # (3, 2): past layer 3's experts
