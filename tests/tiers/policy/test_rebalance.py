"""The rebalancer's plan (tiers.policy.rebalance): the rolling routing window and plan_moves, pure functions over arrays.

A hot newcomer always replaces an expert of its own layer (moves across layers are gone), and a
move needs a newcomer used ``MARGIN`` more and ``SIGNIFICANCE`` standard deviations more than what
it replaces (module constants; ``plan_moves`` still takes both, so the reference plan below can be
checked at other values too). Carrying plans out on a loaded model is tests/tiers/policy/test_rebalancer.py's.
"""
from __future__ import annotations

import inspect
import math
from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.loader.layout import ExpertGrid, ExpertKey
from tiers.policy import rebalance
from tiers.policy.rebalance import MARGIN, SIGNIFICANCE, GroupState, Move, RoutingWindow, plan_moves
from tiers.store.table import Home

K = lambda L, e: ExpertKey(L, e)  # noqa: E731


GRID = ExpertGrid({0: 6})


# -- the rolling window ---------------------------------------------------------------------------
def test_window_counts_the_last_intervals_only():
    w = RoutingWindow(GRID, every_tokens=4, window=2)
    w.count([K(0, 1)] * 3)
    assert w.add_tokens(3) is None  # 3 of 4 tokens: the interval is still open
    f = w.add_tokens(1)
    assert GRID.counter(f) == Counter({K(0, 1): 3})
    w.count([K(0, 2)])
    assert GRID.counter(w.add_tokens(4)) == Counter({K(0, 1): 3, K(0, 2): 1})
    w.count([K(0, 3)])
    w.add(GRID.dense({K(0, 4): 2}))  # counts taken elsewhere (the device's) add to the open interval
    assert GRID.counter(w.add_tokens(10)) == Counter({K(0, 2): 1, K(0, 3): 1, K(0, 4): 2})  # the first interval fell out
    with pytest.raises(KeyError, match="layer 1 expert 0"):
        w.count([K(1, 0)])  # an expert outside the grid is refused, not counted in another's cell


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 6), every=st.integers(1, 5),
       ops=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=6), st.integers(0, 7)), max_size=40))
def test_window_frequency_is_the_sum_of_its_intervals(window, every, ops):
    """Random lookups and token counts: the window's frequency (and every frequency a closing
    interval returns) is the plain sum of the last ``window`` intervals, the open one included,
    with no expert left at zero or below; and the tokens it records are those those intervals
    counted, a call that overfills an interval's every token of it included."""
    w = RoutingWindow(GRID, every_tokens=every, window=window)
    intervals, spans, tokens = [Counter()], [0], 0
    for experts, n in ops:
        keys = [K(0, e) for e in experts]
        w.count(keys)
        intervals[-1].update(keys)
        want = sum(intervals[-window:], Counter())
        got = w.add_tokens(n)
        tokens += n
        spans[-1] += n
        if tokens >= every:
            tokens = 0
            assert GRID.counter(got) == want
            intervals.append(Counter())
            spans.append(0)
        else:
            assert got is None
        assert GRID.counter(w.frequency()) == sum(intervals[-window:], Counter())
        assert (w.closed >= 0).all()
        assert sum(w.spans) == sum(spans[-window:])


# -- the plan ---------------------------------------------------------------------------------------
class Group(NamedTuple):
    """A group as sets of keys (what the reference plan reads); ``plan`` turns it into masks."""

    keys: tuple
    hot: frozenset
    warm: frozenset
    free_places: int
    busy: frozenset = frozenset()


def plan(freq: Counter, g: Group, **kw) -> list[Move]:
    """plan_moves over the grid of the group's and the counts' layers."""
    grid = ExpertGrid.of([*g.keys, *freq])
    return plan_moves(grid.dense(freq, np.float64), GroupState.of(grid, g.keys, g.hot, g.warm, g.free_places, g.busy), **kw)


def test_margin_and_significance_are_the_measured_constants():
    """No config key reaches them any more: plan_moves defaults to the module's constants (what
    the rebalancer plans with), and it takes no ``across_layers``."""
    assert (MARGIN, SIGNIFICANCE) == (0.25, 3.0)
    params = inspect.signature(plan_moves).parameters
    assert params["margin"].default is rebalance.MARGIN and params["significance"].default is rebalance.SIGNIFICANCE
    assert "across_layers" not in params
    keys = (K(0, 0), K(0, 1))
    g = Group(keys, hot=frozenset({K(0, 0)}), warm=frozenset(), free_places=0)
    # 30 against 4: 26 >= 3 * sqrt(34) = 17.5 and 30 > 1.25 * 4: moves at the defaults
    assert plan(Counter({K(0, 1): 30, K(0, 0): 4}), g, max_moves=4) == [Move(K(0, 1), Home.GPU, K(0, 0))]
    # 9 against 4 passes the margin but not 3 standard deviations (5 < 3 * sqrt(13) = 10.8): no move at the defaults
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), g, max_moves=4) == []
    # 16 against 0 passes both (16 >= 12); 8 against 0 passes the margin only (8 < 8.5)
    assert plan(Counter({K(0, 1): 16}), g, max_moves=4) == [Move(K(0, 1), Home.GPU, K(0, 0))]
    assert plan(Counter({K(0, 1): 8}), g, max_moves=4) == []
    # the defaults equal the constants given explicitly, on any counts
    for uses in ([7, 20], [0, 9], [4, 13], [12, 30]):
        freq = Counter({K(0, 0): uses[0], K(0, 1): uses[1]})
        assert plan(freq, g, max_moves=4) == plan(freq, g, max_moves=4, margin=MARGIN, significance=SIGNIFICANCE)


def test_plan_promotes_the_frequent_and_respects_the_margin():
    keys = tuple(K(0, e) for e in range(6))
    g = Group(keys, hot=frozenset({K(0, 0)}), warm=frozenset({K(0, 1), K(0, 2)}), free_places=0)
    freq = Counter({K(0, 5): 10, K(0, 0): 2, K(0, 1): 1, K(0, 2): 9, K(0, 3): 4})
    moves = plan(freq, g, max_moves=4, margin=0.25, significance=0.0)
    assert Move(K(0, 5), Home.GPU, K(0, 0)) in moves
    # warm: 3 (4 uses) replaces 1 (1 use); 0, just demoted from hot, is not a candidate while it is hot
    assert Move(K(0, 3), Home.CPU, K(0, 1)) in moves
    assert all(m.key != K(0, 0) for m in moves)
    # no move when the newcomer is not margin better
    assert plan(Counter({K(0, 5): 5, K(0, 0): 4.5}), Group(keys, frozenset({K(0, 0)}), frozenset(), 0),
                max_moves=4, margin=0.25, significance=0.0) == []


def test_plan_moves_only_on_a_significant_difference():
    """With ``significance`` z, a newcomer must beat its victim by z standard deviations of the
    difference of two Poisson counts, sqrt(new + old), besides the margin: 9 against 4 uses passes
    the margin alone but not z = 3 (5 < 3 * sqrt(13)); 30 against 4 passes both (26 >= 17.5)."""
    keys = (K(0, 0), K(0, 1))
    g = Group(keys, hot=frozenset({K(0, 0)}), warm=frozenset(), free_places=0)
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), g, max_moves=4, margin=0.25, significance=0.0) == [Move(K(0, 1), Home.GPU, K(0, 0))]
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), g, max_moves=4, margin=0.25, significance=3) == []
    assert plan(Counter({K(0, 1): 30, K(0, 0): 4}), g, max_moves=4, margin=0.25, significance=3) == [Move(K(0, 1), Home.GPU, K(0, 0))]
    warm = Group((K(0, 0), K(0, 1)), hot=frozenset(), warm=frozenset({K(0, 0)}), free_places=0)  # the warm plan too
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), warm, max_moves=4, margin=0.25, significance=3) == []
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), warm, max_moves=4, margin=0.25, significance=0.0) == [Move(K(0, 1), Home.CPU, K(0, 0))]


def test_plan_fills_free_places_first_and_skips_busy_and_unused():
    keys = tuple(K(1, e) for e in range(5))
    g = Group(keys, hot=frozenset(), warm=frozenset(), free_places=2, busy=frozenset({K(1, 4)}))
    moves = plan(Counter({K(1, 4): 50, K(1, 3): 5, K(1, 2): 1}), g, max_moves=8, margin=0.0)
    assert moves == [Move(K(1, 3), Home.CPU, None), Move(K(1, 2), Home.CPU, None)]  # free places: no significance needed


plan_inputs = st.tuples(
    st.integers(2, 12).flatmap(lambda n: st.tuples(
        st.just(n),
        st.lists(st.integers(0, 20), min_size=n, max_size=n),
        st.sets(st.integers(0, n - 1)),
        st.sets(st.integers(0, n - 1)),
        st.sets(st.integers(0, n - 1), max_size=2),
        st.integers(0, 3),
    )),
    st.integers(1, 4),
    st.sampled_from([0.0, 0.25, 1.0]),
)
significances = st.sampled_from([0.0, 1.0, SIGNIFICANCE])


def _reference_plan(freq, group, *, max_moves, margin, significance):
    """The plan as specified, sorting every expert of the group (what plan_moves must equal)."""
    def better(new, old):
        return new > old * (1.0 + margin) and new >= old + 1 and new - old >= significance * math.sqrt(new + old)
    desc = lambda ks: sorted(ks, key=lambda k: (-freq[k], k))  # noqa: E731
    asc = lambda ks: sorted(ks, key=lambda k: (freq[k], k))  # noqa: E731
    moves, hot, done = [], set(group.hot), set()
    left = [k for k in group.hot if k not in group.busy]
    for new in desc(k for k in group.keys if k not in hot and k not in group.busy):
        if len(moves) >= max_moves:
            break
        # its own layer's least used hot expert; a layer's first failure ends its moves
        own = [k for k in left if k.layer == new.layer]
        old = min(own, key=lambda k: (freq[k], k), default=None)
        if new.layer in done or old is None or not better(freq[new], freq[old]):
            done.add(new.layer)
            continue
        moves.append(Move(new, Home.GPU, old))
        left.remove(old)
        hot.discard(old)
        hot.add(new)
    promoted = {m.key for m in moves}
    outside = hot | group.hot | group.warm | group.busy
    candidates = [k for k in desc(k for k in group.keys if k not in outside) if freq[k] > 0]
    warm_moves = [Move(new, Home.CPU, None) for new in candidates[: min(group.free_places, max_moves)]]
    for new, old in zip(candidates[len(warm_moves):], asc(k for k in group.warm if k not in promoted and k not in group.busy)):
        if len(warm_moves) >= max_moves or not better(freq[new], freq[old]):
            break
        warm_moves.append(Move(new, Home.CPU, old))
    return moves + warm_moves


@settings(max_examples=400, deadline=None)
@given(plan_inputs, st.booleans(), st.lists(st.integers(0, 2), min_size=12, max_size=12), significances)
def test_plan_equals_the_plan_that_sorts_every_expert(args, other_layer, layer_of, significance):
    """plan_moves picks the least used hot and warm experts without sorting the group; its plan
    equals the one that sorts all of them, ties and unused experts included, over experts of up
    to three layers (and uses of experts outside the group, here layer 9's, are ignored), with hot
    newcomers replacing their own layer's experts, at margins and significances around the constants."""
    (n, uses, hot, warm, busy, free), max_moves, margin = args
    warm -= hot
    key = [K(layer_of[e], e) for e in range(n)]
    keys = tuple(key)
    freq = Counter({key[e]: uses[e] for e in reversed(range(n))})  # counted in no particular order
    if other_layer:
        freq.update({K(9, e): 100 for e in range(n)})
    g = Group(keys, frozenset(key[e] for e in hot), frozenset(key[e] for e in warm), free, frozenset(key[e] for e in busy))
    assert (plan(freq, g, max_moves=max_moves, margin=margin, significance=significance)
            == _reference_plan(freq, g, max_moves=max_moves, margin=margin, significance=significance))


def large_groups(sizes: tuple[int, int], most_uses: int, most_moves: int, layers: int):
    """(n, uses, tier, busy, free places, max_moves, layer of each expert) over groups of ``sizes`` experts."""
    return st.integers(*sizes).flatmap(lambda n: st.tuples(
        st.just(n),
        st.lists(st.integers(0, most_uses), min_size=n, max_size=n),
        st.lists(st.sampled_from("hwc"), min_size=n, max_size=n),
        st.sets(st.integers(0, n - 1), max_size=3),
        st.integers(0, 3),
        st.integers(1, most_moves),
        st.lists(st.integers(0, layers - 1), min_size=n, max_size=n),
    ))


@settings(max_examples=200, deadline=None)
@given(large_groups((20, 90), 4, 4, 3))  # few distinct uses: many ties where the least are cut
def test_plan_equals_the_sorted_plan_over_large_groups(args):
    """Groups over four times ``max_moves``, where the least used are cut out by a partition
    before they are sorted, and layers with more newcomers than ``max_moves``: still the plan
    that sorts every expert."""
    n, uses, tier, busy, free, max_moves, layer_of = args
    key = [K(layer_of[e], e) for e in range(n)]
    freq = Counter({key[e]: uses[e] for e in range(n)})
    g = Group(tuple(key), frozenset(key[e] for e in range(n) if tier[e] == "h"), frozenset(key[e] for e in range(n) if tier[e] == "w"),
              free, frozenset(key[e] for e in busy))
    assert (plan(freq, g, max_moves=max_moves, margin=0.0, significance=0.0)
            == _reference_plan(freq, g, max_moves=max_moves, margin=0.0, significance=0.0))


@settings(max_examples=100, deadline=None)
@given(large_groups((20, 60), 60, 8, 4))  # counts large enough for 3 standard deviations to pass at times
def test_plan_at_the_constants_equals_the_sorted_plan(args):
    """What the rebalancer runs: plan_moves at its defaults (MARGIN, SIGNIFICANCE) is the reference plan at those."""
    n, uses, tier, busy, free, max_moves, layer_of = args
    key = [K(layer_of[e], e) for e in range(n)]
    freq = Counter({key[e]: uses[e] for e in range(n)})
    g = Group(tuple(key), frozenset(key[e] for e in range(n) if tier[e] == "h"), frozenset(key[e] for e in range(n) if tier[e] == "w"),
              free, frozenset(key[e] for e in busy))
    assert plan(freq, g, max_moves=max_moves) == _reference_plan(freq, g, max_moves=max_moves, margin=MARGIN, significance=SIGNIFICANCE)


def test_a_newcomer_replaces_an_equally_unused_hot_expert_of_its_own_layer():
    """Unused hot experts in every layer: the newcomers take their own layers' (each layer keeps
    its hot count and its slots), not layer 0's, which ties broken by key alone would drain."""
    keys = tuple(K(L, e) for L in range(3) for e in range(4))
    hot = frozenset(K(L, e) for L in range(3) for e in (0, 1))
    freq = Counter({K(2, 3): 9, K(1, 2): 8, K(2, 2): 7, K(0, 0): 1})
    moves = plan(freq, Group(keys, hot, frozenset(), 0), max_moves=3, margin=0.25, significance=0.0)
    assert [m for m in moves if m.to is Home.GPU] == [Move(K(2, 3), Home.GPU, K(2, 0)), Move(K(1, 2), Home.GPU, K(1, 0)),
                                                    Move(K(2, 2), Home.GPU, K(2, 1))]
    # a strictly less used hot expert of another layer is never taken: capacity stays in its layer
    freq[K(2, 0)] = freq[K(2, 1)] = 1
    moves = plan(freq, Group(keys, hot, frozenset(), 0), max_moves=1, margin=0.25, significance=0.0)
    assert moves == [Move(K(2, 3), Home.GPU, K(2, 0))]


def test_a_layer_that_cannot_promote_does_not_starve_the_others():
    """Own-layer moves: layer 0's newcomers are the most used of all but cannot beat layer 0's own
    hot experts (used almost as much), and there are more of them than ``max_moves``; layer 1's
    newcomer, the least used newcomer, still replaces layer 1's unused hot expert."""
    keys = tuple(K(L, e) for L in range(2) for e in range(8))
    hot = frozenset({K(0, 0), K(0, 1), K(1, 0)})
    freq = Counter({K(0, 0): 20, K(0, 1): 20, **{K(0, e): 21 for e in range(2, 8)}, K(1, 5): 3})
    assert plan(freq, Group(keys, hot, frozenset(), 0), max_moves=2, margin=0.25, significance=0.0) == [Move(K(1, 5), Home.GPU, K(1, 0))]
    # layer 0 promotes once (into its unused hot expert), then fails: layer 1 still gets its move
    freq[K(0, 0)] = 0
    assert plan(freq, Group(keys, hot, frozenset(), 0), max_moves=3, margin=0.25, significance=0.0) == [
        Move(K(0, 2), Home.GPU, K(0, 0)), Move(K(1, 5), Home.GPU, K(1, 0))]


@settings(max_examples=200, deadline=None)
@given(plan_inputs, significances)
def test_plan_keeps_tier_sizes_and_only_improves(args, significance):
    (n, uses, hot, warm, busy, free), max_moves, margin = args
    warm -= hot
    keys = tuple(K(0, e) for e in range(n))
    freq = Counter({K(0, e): u for e, u in enumerate(uses)})
    g = Group(keys, frozenset(K(0, e) for e in hot), frozenset(K(0, e) for e in warm), free,
              frozenset(K(0, e) for e in busy))
    moves = plan(freq, g, max_moves=max_moves, margin=margin, significance=significance)
    to_gpu = [m for m in moves if m.to is Home.GPU]
    to_cpu = [m for m in moves if m.to is Home.CPU]
    assert len(to_gpu) <= max_moves and len(to_cpu) <= max_moves
    assert len({m.key for m in moves}) == len(moves), "an expert moves once per plan"
    for m in moves:
        assert m.key not in g.busy and m.replaces not in g.busy
        if m.replaces is not None:
            new, old = freq[m.key], freq[m.replaces]
            assert new > old * (1 + margin) and new >= old + 1 and new - old >= significance * math.sqrt(new + old)
    for m in to_gpu:
        assert m.replaces in g.hot and m.key not in g.hot
    assert len({m.replaces for m in to_gpu}) == len(to_gpu)
    for m in to_cpu:
        assert m.key not in g.hot and m.key not in g.warm and freq[m.key] > 0
        assert m.replaces is None or m.replaces in g.warm
    assert sum(m.replaces is None for m in to_cpu) <= free, "never more new warm experts than free places"


@settings(max_examples=300, deadline=None)
@given(plan_inputs, st.lists(st.integers(0, 2), min_size=12, max_size=12), significances)
def test_own_layer_moves_keep_every_layers_hot_count(args, layer_of, significance):
    """A hot newcomer always replaces an expert of its own layer, so after the plan every layer
    holds as many hot experts as before."""
    (n, uses, hot, warm, busy, free), max_moves, margin = args
    key = [K(layer_of[e], e) for e in range(n)]
    g = Group(tuple(key), frozenset(key[e] for e in hot), frozenset(key[e] for e in warm - hot), free, frozenset(key[e] for e in busy))
    moves = plan(Counter({key[e]: uses[e] for e in range(n)}), g, max_moves=max_moves, margin=margin, significance=significance)
    after = (set(g.hot) - {m.replaces for m in moves if m.to is Home.GPU}) | {m.key for m in moves if m.to is Home.GPU}
    assert Counter(k.layer for k in after) == Counter(k.layer for k in g.hot)
    assert all(m.key.layer == m.replaces.layer for m in moves if m.to is Home.GPU)
