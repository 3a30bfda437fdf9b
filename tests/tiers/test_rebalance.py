"""The rebalancer: rolling routing counts, the pure plan, and moves carried out on a real manager.

Engine tests run on the CPU over a packed tiny Mixtral with every tier in bf16, so any expert
served from any tier, before or after a move, must equal its packed weights exactly.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiers
from tiers.loader.layout import ExpertGrid, ExpertKey
from tiers.loader.packed import read_manifest
from tiers.config import load_config
from tiers.disk_store import DiskStore, IntegrityError
from tiers.engine import TierManager
from tiers.integration import manager_of
from tiers.policy import plan_placement
from tiers.rebalance import GroupState, Move, RoutingWindow, plan_moves
from tiers.residency import Home

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

def test_plan_promotes_the_frequent_and_respects_the_margin():
    keys = tuple(K(0, e) for e in range(6))
    g = Group(keys, hot=frozenset({K(0, 0)}), warm=frozenset({K(0, 1), K(0, 2)}), free_places=0)
    freq = Counter({K(0, 5): 10, K(0, 0): 2, K(0, 1): 1, K(0, 2): 9, K(0, 3): 4})
    moves = plan(freq, g, max_moves=4, margin=0.25)
    assert Move(K(0, 5), Home.GPU, K(0, 0)) in moves
    # warm: 3 (4 uses) replaces 1 (1 use); 0, just demoted from hot, is not a candidate while it is hot
    assert Move(K(0, 3), Home.CPU, K(0, 1)) in moves
    assert all(m.key != K(0, 0) for m in moves)
    # no move when the newcomer is not margin better
    assert plan(Counter({K(0, 5): 5, K(0, 0): 4.5}), Group(keys, frozenset({K(0, 0)}), frozenset(), 0),
                      max_moves=4, margin=0.25) == []


def test_plan_moves_only_on_a_significant_difference():
    """With ``significance`` z, a newcomer must beat its victim by z standard deviations of the
    difference of two Poisson counts, sqrt(new + old), besides the margin: 9 against 4 uses passes
    the margin alone but not z = 3 (5 < 3 * sqrt(13)); 30 against 4 passes both (26 >= 17.5)."""
    keys = (K(0, 0), K(0, 1))
    g = Group(keys, hot=frozenset({K(0, 0)}), warm=frozenset(), free_places=0)
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), g, max_moves=4, margin=0.25) == [Move(K(0, 1), Home.GPU, K(0, 0))]
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), g, max_moves=4, margin=0.25, significance=3) == []
    assert plan(Counter({K(0, 1): 30, K(0, 0): 4}), g, max_moves=4, margin=0.25, significance=3) == [Move(K(0, 1), Home.GPU, K(0, 0))]
    warm = Group((K(0, 0), K(0, 1)), hot=frozenset(), warm=frozenset({K(0, 0)}), free_places=0)  # the warm plan too
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), warm, max_moves=4, margin=0.25, significance=3) == []
    assert plan(Counter({K(0, 1): 9, K(0, 0): 4}), warm, max_moves=4, margin=0.25) == [Move(K(0, 1), Home.CPU, K(0, 0))]


def test_plan_fills_free_places_first_and_skips_busy_and_unused():
    keys = tuple(K(1, e) for e in range(5))
    g = Group(keys, hot=frozenset(), warm=frozenset(), free_places=2, busy=frozenset({K(1, 4)}))
    moves = plan(Counter({K(1, 4): 50, K(1, 3): 5, K(1, 2): 1}), g, max_moves=8, margin=0.0)
    assert moves == [Move(K(1, 3), Home.CPU, None), Move(K(1, 2), Home.CPU, None)]


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


def _reference_plan(freq, group, *, max_moves, margin, across_layers=False):
    """The plan as specified, sorting every expert of the group (what plan_moves must equal)."""
    better = lambda new, old: new > old * (1.0 + margin) and new >= old + 1  # noqa: E731
    desc = lambda ks: sorted(ks, key=lambda k: (-freq[k], k))  # noqa: E731
    asc = lambda ks: sorted(ks, key=lambda k: (freq[k], k))  # noqa: E731
    moves, hot, done = [], set(group.hot), set()
    left = [k for k in group.hot if k not in group.busy]
    for new in desc(k for k in group.keys if k not in hot and k not in group.busy):
        if len(moves) >= max_moves:
            break
        if not across_layers:  # its own layer's least used hot expert; a layer's first failure ends its moves
            own = [k for k in left if k.layer == new.layer]
            old = min(own, key=lambda k: (freq[k], k), default=None)
            if new.layer in done or old is None or not better(freq[new], freq[old]):
                done.add(new.layer)
                continue
        else:
            if not left:
                break
            old = min(left, key=lambda k: (freq[k], k.layer != new.layer, k))  # the least used, of its own layer on a tie
            if not better(freq[new], freq[old]):
                break
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
@given(plan_inputs, st.booleans(), st.lists(st.integers(0, 2), min_size=12, max_size=12), st.booleans())
def test_plan_equals_the_plan_that_sorts_every_expert(args, other_layer, layer_of, across_layers):
    """plan_moves picks the least used hot and warm experts without sorting the group; its plan
    equals the one that sorts all of them, ties and unused experts included, over experts of up
    to three layers (and uses of experts outside the group, here layer 9's, are ignored), with hot
    newcomers replacing their own layer's experts or any layer's."""
    (n, uses, hot, warm, busy, free), max_moves, margin = args
    warm -= hot
    key = [K(layer_of[e], e) for e in range(n)]
    keys = tuple(key)
    freq = Counter({key[e]: uses[e] for e in reversed(range(n))})  # counted in no particular order
    if other_layer:
        freq.update({K(9, e): 100 for e in range(n)})
    g = Group(keys, frozenset(key[e] for e in hot), frozenset(key[e] for e in warm), free, frozenset(key[e] for e in busy))
    assert (plan(freq, g, max_moves=max_moves, margin=margin, across_layers=across_layers)
            == _reference_plan(freq, g, max_moves=max_moves, margin=margin, across_layers=across_layers))


@settings(max_examples=200, deadline=None)
@given(st.integers(20, 90).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.integers(0, 4), min_size=n, max_size=n),  # few distinct uses: many ties where the least are cut
    st.lists(st.sampled_from("hwc"), min_size=n, max_size=n),
    st.sets(st.integers(0, n - 1), max_size=3),
    st.integers(0, 3),
    st.integers(1, 4),
    st.lists(st.integers(0, 2), min_size=n, max_size=n),
)), st.booleans())
def test_plan_equals_the_sorted_plan_over_large_groups(args, across_layers):
    """Groups over four times ``max_moves``, where the least used are cut out by a partition
    before they are sorted, and layers with more newcomers than ``max_moves``: still the plan
    that sorts every expert."""
    n, uses, tier, busy, free, max_moves, layer_of = args
    key = [K(layer_of[e], e) for e in range(n)]
    freq = Counter({key[e]: uses[e] for e in range(n)})
    g = Group(tuple(key), frozenset(key[e] for e in range(n) if tier[e] == "h"), frozenset(key[e] for e in range(n) if tier[e] == "w"),
              free, frozenset(key[e] for e in busy))
    assert (plan(freq, g, max_moves=max_moves, margin=0.0, across_layers=across_layers)
            == _reference_plan(freq, g, max_moves=max_moves, margin=0.0, across_layers=across_layers))


@pytest.mark.parametrize("across_layers", [False, True])
def test_a_newcomer_replaces_an_equally_unused_hot_expert_of_its_own_layer(across_layers):
    """Unused hot experts in every layer: the newcomers take their own layers' (each layer keeps
    its hot count and its slots), not layer 0's, which ties broken by key alone would drain."""
    keys = tuple(K(L, e) for L in range(3) for e in range(4))
    hot = frozenset(K(L, e) for L in range(3) for e in (0, 1))
    freq = Counter({K(2, 3): 9, K(1, 2): 8, K(2, 2): 7, K(0, 0): 1})
    moves = plan(freq, Group(keys, hot, frozenset(), 0), max_moves=3, margin=0.25, across_layers=across_layers)
    assert [m for m in moves if m.to is Home.GPU] == [Move(K(2, 3), Home.GPU, K(2, 0)), Move(K(1, 2), Home.GPU, K(1, 0)),
                                                    Move(K(2, 2), Home.GPU, K(2, 1))]
    # a strictly less used hot expert of another layer: taken only across layers (capacity moves)
    freq[K(2, 0)] = freq[K(2, 1)] = 1
    moves = plan(freq, Group(keys, hot, frozenset(), 0), max_moves=1, margin=0.25, across_layers=across_layers)
    assert moves == [Move(K(2, 3), Home.GPU, K(0, 1) if across_layers else K(2, 0))]


def test_a_layer_that_cannot_promote_does_not_starve_the_others():
    """Own-layer moves: layer 0's newcomers are the most used of all but cannot beat layer 0's own
    hot experts (used almost as much), and there are more of them than ``max_moves``; layer 1's
    newcomer, the least used newcomer, still replaces layer 1's unused hot expert. Across layers
    layer 0's newcomers would take layer 1's expert instead."""
    keys = tuple(K(L, e) for L in range(2) for e in range(8))
    hot = frozenset({K(0, 0), K(0, 1), K(1, 0)})
    freq = Counter({K(0, 0): 20, K(0, 1): 20, **{K(0, e): 21 for e in range(2, 8)}, K(1, 5): 3})
    assert plan(freq, Group(keys, hot, frozenset(), 0), max_moves=2, margin=0.25) == [Move(K(1, 5), Home.GPU, K(1, 0))]
    assert plan(freq, Group(keys, hot, frozenset(), 0), max_moves=2, margin=0.25, across_layers=True) == [Move(K(0, 2), Home.GPU, K(1, 0))]
    # layer 0 promotes once (into its unused hot expert), then fails: layer 1 still gets its move
    freq[K(0, 0)] = 0
    assert plan(freq, Group(keys, hot, frozenset(), 0), max_moves=3, margin=0.25) == [Move(K(0, 2), Home.GPU, K(0, 0)),
                                                                                      Move(K(1, 5), Home.GPU, K(1, 0))]


@settings(max_examples=200, deadline=None)
@given(plan_inputs)
def test_plan_keeps_tier_sizes_and_only_improves(args):
    (n, uses, hot, warm, busy, free), max_moves, margin = args
    warm -= hot
    keys = tuple(K(0, e) for e in range(n))
    freq = Counter({K(0, e): u for e, u in enumerate(uses)})
    g = Group(keys, frozenset(K(0, e) for e in hot), frozenset(K(0, e) for e in warm), free,
                   frozenset(K(0, e) for e in busy))
    moves = plan(freq, g, max_moves=max_moves, margin=margin)
    to_gpu = [m for m in moves if m.to is Home.GPU]
    to_cpu = [m for m in moves if m.to is Home.CPU]
    assert len(to_gpu) <= max_moves and len(to_cpu) <= max_moves
    assert len({m.key for m in moves}) == len(moves), "an expert moves once per plan"
    for m in moves:
        assert m.key not in g.busy and m.replaces not in g.busy
        if m.replaces is not None:
            assert freq[m.key] > freq[m.replaces] * (1 + margin) and freq[m.key] >= freq[m.replaces] + 1
    for m in to_gpu:
        assert m.replaces in g.hot and m.key not in g.hot
    assert len({m.replaces for m in to_gpu}) == len(to_gpu)
    for m in to_cpu:
        assert m.key not in g.hot and m.key not in g.warm and freq[m.key] > 0
        assert m.replaces is None or m.replaces in g.warm
    assert sum(m.replaces is None for m in to_cpu) <= free, "never more new warm experts than free places"


@settings(max_examples=300, deadline=None)
@given(plan_inputs, st.lists(st.integers(0, 2), min_size=12, max_size=12))
def test_own_layer_moves_keep_every_layers_hot_count(args, layer_of):
    """By default a hot newcomer always replaces an expert of its own layer, so after the plan
    every layer holds as many hot experts as before."""
    (n, uses, hot, warm, busy, free), max_moves, margin = args
    key = [K(layer_of[e], e) for e in range(n)]
    g = Group(tuple(key), frozenset(key[e] for e in hot), frozenset(key[e] for e in warm - hot), free, frozenset(key[e] for e in busy))
    moves = plan(Counter({key[e]: uses[e] for e in range(n)}), g, max_moves=max_moves, margin=margin)
    after = (set(g.hot) - {m.replaces for m in moves if m.to is Home.GPU}) | {m.key for m in moves if m.to is Home.GPU}
    assert Counter(k.layer for k in after) == Counter(k.layer for k in g.hot)


# -- on a manager -------------------------------------------------------------------------------
BF16 = {"gpu": {"fraction": 0.25, "staging_slots": 2, "precision": "bf16"}, "cpu": {"fraction": 0.25, "precision": "bf16"},
        "nvme": {"precision": "bf16"}}


def manager(packed, every=4, **rebalance) -> TierManager:
    cfg = load_config({"tiers": BF16 | {"rebalance": {"every_tokens": every, "margin": 0.0, "significance": 0.0} | rebalance}})
    manifest = read_manifest(packed)
    return TierManager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), progress=False)


@pytest.fixture
def truth(packed_factory):
    manifest = read_manifest(packed_factory("mixtral"))
    disk = DiskStore(manifest, ["bf16"])
    out = {}
    for k in manifest.keys:
        buf = torch.empty(manifest.ref(k, "bf16").nbytes, dtype=torch.uint8)
        disk.read(k, "bf16", buf)
        layout = manifest.layers[k.layer].layout
        t = {x.name: torch.empty(x.shape, dtype=torch.bfloat16) for x in layout.tensors}
        manifest.blob(k, "bf16").dequantize_into(buf, t)
        out[k] = t
    disk.close()
    return out


def drive(mgr, calls, truth):
    """Serve ``calls`` (layer, experts) one token each, checking every served expert bit-exactly."""
    for layer, experts in calls:
        mgr.begin_call(layer, experts, 1)
        for e, w in mgr.serve_layer(layer, experts):
            for name, t in w.items():
                assert torch.equal(t, truth[ExpertKey(layer, e)][name]), f"{ExpertKey(layer, e)} {name} differs after a move"


def skewed_calls(tokens, favourite):
    return [(L, sorted({favourite[L], (t * 3 + L) % 8})) for t in range(tokens) for L in range(3)]


def test_frequent_experts_become_hot_and_warm_exactly(packed_factory, truth):
    mgr = manager(packed_factory("mixtral"), every=4)
    hot0 = {k for k, r in mgr.table.items() if r.pinned}
    warm0 = sum(r.home is Home.CPU for _, r in mgr.table.items())
    used0 = mgr.host.used
    favourite = {L: next(e for e in range(7, -1, -1) if not mgr.table[K(L, e)].pinned) for L in range(3)}
    drive(mgr, skewed_calls(24, favourite), truth)
    mgr.rebalancer.land(wait=True)
    drive(mgr, skewed_calls(8, favourite), truth)  # serve again after the swaps
    hot = {k for k, r in mgr.table.items() if r.pinned}
    assert {K(L, e) for L, e in favourite.items()} <= hot, "the favourites were promoted"
    assert len(hot) == len(hot0), "the hot set keeps its slot count"
    assert sum(r.home is Home.CPU for _, r in mgr.table.items()) == warm0, "the warm set keeps its size"
    assert mgr.host.used == used0, "the host pool never grows"
    s = mgr.stats()
    assert s.rebalance["promoted_hot"] >= 3 and s.rebalance["rebalances"] >= 5
    assert s.bytes_moved["rebalance"] > 0
    assert s.residency["gpu"]["experts"] == len(hot)
    for k, r in mgr.table.items():  # the table's invariants after many moves
        assert r.pinned == (r.home is Home.GPU)
        assert (r.home is Home.CPU) == (r.host_offset is not None)
    offsets = [r.host_offset for _, r in mgr.table.items() if r.host_offset is not None]
    assert len(offsets) == len(set(offsets)), "two warm experts share host bytes"
    mgr.close()


@pytest.mark.parametrize("across_layers", [False, True])
def test_the_manager_moves_hot_capacity_across_layers_only_when_told(packed_factory, truth, across_layers):
    """``tiers.rebalance.across_layers``: layer 0's hot experts are used, the other layers' not;
    a newcomer of layer 0 replaces one of layer 0's own (every layer keeps its hot count and its
    slots), or with the flag an unused expert of another layer, whose slot it takes."""
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1, across_layers=across_layers)
    hot_of = lambda: Counter(k.layer for k, r in mgr.table.items() if r.pinned)  # noqa: E731
    slots_of = lambda L: sorted(r.slot for k, r in mgr.table.items() if r.pinned and k.layer == L)  # noqa: E731
    before, slots0 = hot_of(), slots_of(0)
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].pinned)
    mgr.rebalancer.window.count([newcomer] * 20 + [k for k, r in mgr.table.items() if r.pinned and k.layer == 0] * 3)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].pinned
    after = hot_of()
    if across_layers:
        assert after[0] == before[0] + 1 and sum(after.values()) == sum(before.values())
        assert set(slots0) < set(slots_of(0)), "layer 0 keeps its slots and takes another layer's"
    else:
        assert after == before and slots_of(0) == slots0
    drive(mgr, [(0, [newcomer.expert])], truth)
    mgr.close()


def test_a_held_hot_slot_is_not_swapped_until_released(packed_factory, truth):
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    victim = min((k for k, r in mgr.table.items() if r.pinned and k.layer == 0), key=lambda k: k.expert)
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].pinned)
    gen = mgr.serve_layer(0, [victim.expert])
    next(gen)  # the victim's slot is held
    mgr.rebalancer.window.count([newcomer] * 5)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert mgr.table[victim].pinned, "swapped while held"
    gen.close()
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].pinned and not mgr.table[victim].pinned
    drive(mgr, [(0, [newcomer.expert, victim.expert])], truth)
    mgr.close()


def test_a_promotion_never_waits_for_a_buffers_last_copy_up(packed_factory, truth):
    """A promotion buffer whose last copy up the device has not run yet is not free: the
    rebalancer issues no hot move into it rather than wait for it (a host sync behind every copy
    queued before it), and issues the move at a later rebalance once that copy is done."""
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    rb = mgr.rebalancer

    class Queued:  # a copy up the device has not run: waiting for it would block the host
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("the rebalancer waited for a buffer's copy up")
    queued = [Queued() for _ in rb.buffers]
    rb.buffer_busy[:] = queued
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].pinned)
    rb.window.count([newcomer] * 20)
    assert rb.rebalance(rb.window.frequency()) == [] and not rb.hot_reads
    queued[-1].done = True  # one buffer's copy up has run: that one is free
    moves = rb.rebalance(rb.window.frequency())
    assert [m.key for m in moves] == [newcomer] and [r.buffer for r in rb.hot_reads.values()] == [len(rb.buffers) - 1]
    rb.land(wait=True)
    assert mgr.table[newcomer].pinned
    drive(mgr, [(0, [newcomer.expert])], truth)
    mgr.close()


def test_hot_swap_forks_the_compute_stream_before_the_copy(packed_factory):
    """The outgoing hot slot has no last-read event: the copy stream must wait on an event
    recorded on the compute stream at the swap, before the copy into the slot is queued."""
    from test_slots import Recorder, RecordingStreams

    rec = Recorder()
    streams = RecordingStreams(rec)
    cfg = load_config({"tiers": BF16 | {"rebalance": {"every_tokens": 1, "margin": 0.0, "significance": 0.0, "max_moves": 1}}})
    manifest = read_manifest(packed_factory("mixtral"))
    mgr = TierManager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), streams=streams, progress=False)
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].pinned)
    mgr.rebalancer.window.count([newcomer] * 5)
    start = len(rec.order)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].pinned
    order = rec.order[start:]
    fork = next(i for i, o in enumerate(order) if o[0] == "record" and o[1] is streams.compute)
    waits = [i for i, o in enumerate(order) if o[0] == "wait" and o[1] is mgr.copy_stream and o[2] is order[fork][2]]
    uses = [i for i, o in enumerate(order) if o[0] == "use" and o[1] is mgr.copy_stream]
    assert waits and uses and fork < waits[0] < uses[-1]
    mgr.close()


def test_a_host_place_is_refilled_only_after_every_queued_read_of_it(packed_factory, monkeypatch):
    """Direct decode kernels read warm places on the compute stream, copies and direct stacks on
    the copy stream: the fence a rebalance read waits on before refilling a place is recorded on
    the copy stream after it waited on an event recorded on the compute stream. The fence is a
    blocking event: the rebalance thread sleeps while it waits, behind a prefill's reads at times,
    instead of spinning a core the serving thread may need."""
    from test_slots import Recorder, RecordingStreams

    rec = Recorder()
    streams = RecordingStreams(rec)
    cfg = load_config({"tiers": BF16 | {"rebalance": {"every_tokens": 1, "margin": 0.0, "significance": 0.0, "max_moves": 1}}})
    manifest = read_manifest(packed_factory("mixtral"))
    mgr = TierManager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), streams=streams, progress=False)
    fences = []
    read_after = mgr.rebalancer._read_after
    monkeypatch.setattr(mgr.rebalancer, "_read_after", lambda fence, *a: fences.append(fence) or read_after(fence, *a))
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].pinned)
    mgr.rebalancer.window.count([newcomer] * 5)
    start = len(rec.order)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert fences, "the swap must refill a place (the demoted expert's cpu blob)"
    order = rec.order[start:]
    for fence in fences:
        assert fence.blocking, "a rebalance thread's fence must not spin"
        at = next(i for i, o in enumerate(order) if o[0] == "record" and o[2] is fence)
        assert order[at][1] is mgr.copy_stream
        compute = [o[2] for o in order[:at] if o[0] == "record" and o[1] is streams.compute]
        assert any(o[0] == "wait" and o[1] is mgr.copy_stream and o[2] is ev for ev in compute for o in order[:at])
    mgr.close()


def test_a_failed_warm_read_leaves_the_expert_on_disk(packed_factory, truth, monkeypatch):
    mgr = manager(packed_factory("mixtral"), every=1)
    cold = next(k for k, r in mgr.table.items() if r.home is Home.NVME)
    warm = [k for k, r in mgr.table.items() if r.home is Home.CPU]
    real = mgr.disk.read

    def failing(key, precision, out):
        if key == cold:
            raise IntegrityError(f"checksum mismatch for {key}")
        return real(key, precision, out)

    monkeypatch.setattr(mgr.disk, "read", failing)
    mgr.rebalancer.window.count([cold] * 9 + [k for k, r in mgr.table.items() if r.pinned] * 20)  # hot stays hot
    moves = mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    assert any(m.key == cold and m.to is Home.CPU for m in moves)
    mgr.rebalancer.land(wait=True)
    assert mgr.table[cold].home is Home.NVME
    assert mgr.stats().rebalance["read_errors"] == 1
    replaced = [k for k in warm if mgr.table[k].home is Home.NVME]
    assert len(mgr.rebalancer.free_places[id(mgr.pool_of[cold.layer])]) == len(replaced), "its place is free again"
    monkeypatch.setattr(mgr.disk, "read", real)
    drive(mgr, [(cold.layer, [cold.expert])] + [(k.layer, [k.expert]) for k in replaced], truth)
    mgr.close()


def test_missing_precision_for_rebalancing_names_the_key(packed_factory):
    packed = packed_factory("mixtral", ("bf16",))
    cfg = {"tiers": {"gpu": {"fraction": 0.3}, "cpu": {"precision": "bf16", "budget": "1GiB"}, "nvme": {"precision": "int8"}}}
    tiers.load(packed, cfg, device="cpu", progress=False)  # nothing is cold: int8 is not needed
    cfg["tiers"]["rebalance"] = {"every_tokens": 8}  # ... until experts may be demoted to disk
    with pytest.raises(ValueError, match=r"tiers\.rebalance: moving experts between tiers needs tiers\.nvme\.precision 'int8'"):
        tiers.load(packed, cfg, device="cpu", progress=False)


@pytest.mark.parametrize("compute", ["grouped", "eager"])
def test_generate_with_rebalancing_is_bit_identical(compute, device, checkpoint_factory, packed_factory):
    """All tiers bf16: moving experts between tiers while generating changes no logit."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("eager" if compute == "eager" else "grouped_mm")
    cfg = {"tiers": BF16 | {"gpu": BF16["gpu"] | {"compute": compute, "staging_slots": 8, "fraction": 0.6},
                            "rebalance": {"every_tokens": 2, "margin": 0.0, "significance": 0.0, "window": 2}}}
    model = tiers.load(packed_factory("mixtral"), cfg, device=device, progress=False)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)
    s = tiers.stats(model)
    assert s.rebalance["rebalances"] >= 10 and s.rebalance["promoted_hot"] + s.rebalance["promoted_warm"] > 0
    manager_of(model).close()


def test_back_to_back_long_prompts_with_rebalancing_are_bit_identical(checkpoint_factory, packed_factory):
    """Long prompts, one after another, read their layers whole (no host sync); each forward's
    calls are counted after a later forward's last layer, where the rebalances they close are
    planned and the swaps of earlier ones land. Moving experts between those forwards changes no
    logit of any prompt, nor of a generate after them (all tiers bf16, the CPU: bit-identical)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen3_moe"), dtype=torch.bfloat16).eval()
    ref.set_experts_implementation("grouped_mm")
    cfg = {"tiers": {"gpu": {"fraction": 0.4, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                     "nvme": {"precision": "bf16"},  # every expert not hot is warm: the layers can be read whole
                     "rebalance": {"every_tokens": 2, "margin": 0.0, "significance": 0.0, "window": 2}}}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False)
    mgr = manager_of(model)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (1, 64), generator=g) for _ in range(6)]
    assert all(mgr.whole_layer(L, 64, model.config.num_experts_per_tok) for L in mgr.manifest.layers if L not in mgr.static_maps)
    hot0 = {k for k, r in mgr.table.items() if r.pinned}
    with torch.no_grad():
        for ids in prompts:
            assert torch.equal(ref(ids).logits, model(ids).logits)
    assert mgr.stats_.whole_calls >= len(prompts), "the prompts did not read their layers whole"
    mgr.rebalancer.land(wait=True)
    assert {k for k, r in mgr.table.items() if r.pinned} != hot0, "nothing moved between the prompts"
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    a, b = ref.generate(prompts[0], **kw), model.generate(prompts[0], **kw)
    assert torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    s = tiers.stats(model)
    assert s.rebalance["rebalances"] >= len(prompts) - 1 and s.rebalance["promoted_hot"] > 0
    mgr.close()


@pytest.mark.parametrize("fail_out", [False, True])
def test_a_demoted_hot_expert_is_warm_at_once(packed_factory, truth, monkeypatch, fail_out):
    """The outgoing expert's cpu blob is read before the swap, so it never becomes a disk read on
    the serving path; if that read fails it lives on disk (still served exactly)."""
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    victim = min((k for k, r in mgr.table.items() if r.pinned and k.layer == 0), key=lambda k: k.expert)
    newcomer = next(K(0, e) for e in range(8) if mgr.table[K(0, e)].home is Home.NVME)
    warm0 = sum(r.home is Home.CPU for _, r in mgr.table.items())
    real = mgr.disk.read

    def read(key, precision, out):
        if fail_out and key == victim:
            raise IntegrityError(f"checksum mismatch for {key}")
        return real(key, precision, out)

    monkeypatch.setattr(mgr.disk, "read", read)
    others = [k for k, r in mgr.table.items() if r.pinned and k != victim]
    mgr.rebalancer.window.count([newcomer] * 5 + others * 20)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].pinned
    assert mgr.table[victim].home is (Home.NVME if fail_out else Home.CPU)
    # a newcomer from disk: the least used warm expert was cooled, so the warm set keeps its size
    assert sum(r.home is Home.CPU for _, r in mgr.table.items()) == warm0
    monkeypatch.setattr(mgr.disk, "read", real)
    before = mgr.stats().hits
    drive(mgr, [(0, [victim.expert])], truth)
    after = mgr.stats().hits
    assert after["nvme" if fail_out else "cpu"] == before["nvme" if fail_out else "cpu"] + 1
    mgr.close()


def test_swaps_land_between_forwards_only(packed_factory, truth):
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].pinned)
    mgr.rebalancer.window.count([newcomer] * 5 + [k for k, r in mgr.table.items() if r.pinned and k.layer != 0] * 20)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    for f in [r.future for r in mgr.rebalancer.hot_reads.values()] + [r.out_future for r in mgr.rebalancer.hot_reads.values()]:
        f.result()  # the reads have landed
    drive(mgr, [(1, [0, 1]), (2, [3])], truth)  # later layers of a forward: nothing is swapped
    assert not mgr.table[newcomer].pinned and mgr.rebalancer.hot_reads
    drive(mgr, [(0, [5])], truth)  # the next forward begins
    assert mgr.table[newcomer].pinned
    mgr.close()


def _free_places(rb) -> list[int]:
    """Host places no warm expert holds now: spares, places being read into or copied to, free ones."""
    return ([o for spares in rb.spares.values() for o in spares] + [r.spare for r in rb.hot_reads.values()]
            + [o for _, o in rb.warm_reads.values()] + [place for _, _, place in rb.relocations.values()]
            + [o for places in rb.free_places.values() for o in places])


@pytest.mark.parametrize("threads", [2, 0])
def test_a_demoted_expert_takes_the_place_its_newcomer_left(packed_factory, truth, threads):
    """A swap reads the outgoing expert into a spare place; once nothing reads the newcomer's old
    place any more the outgoing one is copied there, and the spare is free again: each layer's
    warm experts keep the places load gave them, so a part's reads stay back to back. Without
    reader threads the copy runs on the serving thread."""
    cfg = load_config({"tiers": BF16 | {"nvme": {"precision": "bf16", "reader_threads": threads},
                                        "rebalance": {"every_tokens": 1, "margin": 0.0, "significance": 0.0, "max_moves": 1}}})
    manifest = read_manifest(packed_factory("mixtral"))
    mgr = TierManager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), progress=False)
    assert (mgr.rebalancer.pool is None) == (threads == 0)
    newcomer = next(K(0, e) for e in range(8) if mgr.table[K(0, e)].home is Home.CPU)
    place = mgr.table[newcomer].host_offset
    spares0 = sorted(o for sp in mgr.rebalancer.spares.values() for o in sp)
    mgr.rebalancer.window.count([newcomer] * 5 + [k for k, r in mgr.table.items() if r.pinned and k.layer != 0] * 20)
    victim = next(iter(mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency()))).replaces
    assert victim.layer == 0
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].pinned and mgr.table[victim].host_offset == place
    assert sorted(o for sp in mgr.rebalancer.spares.values() for o in sp) == spares0 and not mgr.rebalancer.relocations
    drive(mgr, [(0, [victim.expert])], truth)  # served exactly from its new place
    assert mgr.stats().hits["cpu"] >= 1
    mgr.close()


# -- the whole engine under random calls, rebalances and landings ---------------------------------
engine_steps = st.lists(
    st.one_of(
        st.tuples(st.just("call"), st.integers(0, 2), st.sets(st.integers(0, 7), min_size=1, max_size=4)),
        st.tuples(st.just("favour"), st.integers(0, 2), st.integers(0, 7)),
        st.tuples(st.just("rebalance"), st.booleans()),  # True: wait for every read first
        st.tuples(st.just("prefetch"), st.integers(0, 2), st.sets(st.integers(0, 7), max_size=3)),
    ),
    min_size=1, max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # truth is read-only
@given(steps=engine_steps)
def test_random_calls_and_moves_keep_every_invariant(packed_factory, truth, steps):
    """Calls serve exact weights; the hot set keeps its size, the warm set its size, no two warm
    experts share bytes, the table's invariants hold, and no slot stays held."""
    mgr = manager(packed_factory("mixtral"), every=10**6, max_moves=2)  # rounds only when the test says
    hot0 = sum(r.pinned for _, r in mgr.table.items())
    warm0 = sum(r.home is Home.CPU for _, r in mgr.table.items())
    places0 = sorted([r.host_offset for _, r in mgr.table.items() if r.host_offset is not None] + _free_places(mgr.rebalancer))
    try:
        for step in steps:
            if step[0] == "call":
                _, layer, experts = step
                drive(mgr, [(0, [0])] if layer else [], truth)  # a forward starts at the first layer
                drive(mgr, [(layer, sorted(experts))], truth)
            elif step[0] == "favour":
                mgr.rebalancer.window.count([K(step[1], step[2])] * 7)
            elif step[0] == "prefetch":
                mgr.prefetch(step[1], sorted(step[2]))
            else:
                mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
                if step[1]:
                    mgr.drain()
                    mgr.rebalancer.land(wait=True)
            table = dict(mgr.table.items())
            assert sum(r.pinned for r in table.values()) == hot0
            assert sum(r.home is Home.CPU for r in table.values()) <= warm0
            offsets = [r.host_offset for r in table.values() if r.host_offset is not None]
            assert len(offsets) == len(set(offsets))
            assert sorted(offsets + _free_places(mgr.rebalancer)) == places0, "a host place leaked or is held twice"
            for k, r in table.items():
                assert r.pinned == (r.home is Home.GPU)
                assert (r.home is Home.CPU) == (r.host_offset is not None)
            assert all(x == 0 for p in mgr.pools for s, x in enumerate(p.readers) if (id(p), s) not in mgr.pending)
        mgr.drain()
        mgr.rebalancer.land(wait=True)
        drive(mgr, [(L, list(range(8))) for L in range(3)], truth)  # every expert, wherever it lives now
    finally:
        mgr.close()
