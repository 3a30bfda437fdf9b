"""The staging slots' cache policy (tiers.policy.slot_cache): the layer-aware Markov forecast, its
victim rule, and its replay against Belady's MIN."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.loader.layout import ExpertKey
from tiers.policy import slot_cache
from tiers.policy.slot_cache import SlotCache, belady_hits, replay
from tiers.store.table import Home, Residency, Table
from tiers.tools.trace import TraceModel, lookups


def brute_force_optimum(seq, capacity):
    """Exhaustive search over every eviction choice: the true optimum for tiny traces."""
    best = 0

    def go(i, cache, hits):
        nonlocal best
        if i == len(seq):
            best = max(best, hits)
            return
        k = seq[i]
        if k in cache:
            go(i + 1, cache, hits + 1)
        elif len(cache) < capacity:
            go(i + 1, cache | {k}, hits)
        else:
            for out in cache:
                go(i + 1, (cache - {out}) | {k}, hits)

    go(0, frozenset(), 0)
    return best


def cache_over(keys, capacity: int, layers=(0,), experts: int | None = None, cls=SlotCache) -> tuple[SlotCache, Table]:
    """A policy over one pool of ``capacity`` staging slots (no hot ones) holding ``keys``' layers, all on disk."""
    keys = list(keys)
    table = Table({k: Residency(Home.NVME) for k in keys}, [capacity], dict.fromkeys({k.layer for k in keys} | set(layers), 0))
    return cls(table, 0, range(capacity), list(layers), experts), table


def put(c: SlotCache, table: Table, slot: int, key: ExpertKey) -> None:
    """``key`` staged into ``slot`` (its occupant leaving), as ``Slots.claim`` does."""
    table.stage(key, 0, slot)
    c.touch(slot)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=11), st.integers(1, 3))
def test_belady_is_optimal_on_small_traces(raw, capacity):
    seq = [ExpertKey(0, e) for e in raw]
    assert belady_hits(seq, capacity, set()) == brute_force_optimum(seq, capacity)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)), min_size=1, max_size=200), st.integers(1, 5))
def test_the_policy_never_beats_belady(raw, capacity):
    seq = [ExpertKey(layer, e) for layer, e in raw]
    assert replay(seq, capacity, set()) <= belady_hits(seq, capacity, set())


def test_hot_keys_are_excluded():
    seq = [ExpertKey(0, e) for e in [0, 1, 0, 1, 2, 0]]
    assert belady_hits(seq, 1, {ExpertKey(0, 0)}) == 1  # 1 1 2 -> one hit
    assert replay(seq, 1, {ExpertKey(0, 0)}) == 1


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)), min_size=1, max_size=200), st.integers(1, 5))
def test_replay_is_deterministic(raw, capacity):
    """Time is counted in lookups and calls, never a clock: the same trace gives the same hits,
    and two caches fed the same lookups choose the same victims."""
    seq = [ExpertKey(layer, e) for layer, e in raw]
    assert replay(seq, capacity, set()) == replay(list(seq), capacity, set())
    runs = []
    for _ in range(2):
        c, table = cache_over({*seq}, capacity, layers=[0, 1, 2], experts=8)
        chosen = []
        for i, key in enumerate(seq):
            if i == 0 or key.layer != seq[i - 1].layer:
                c.visit(key.layer, [key])
            c.access(key)
            if table[key].slot is not None:
                c.touch(table[key].slot)
                continue
            s = c.victim()
            chosen.append(s)
            put(c, table, s, key)
        runs.append(chosen)
    assert runs[0] == runs[1]


# -- the victim rule ------------------------------------------------------------------------------
def test_an_empty_slot_is_taken_first():
    keys = [ExpertKey(0, e) for e in range(3)]
    c, table = cache_over(keys, 2, experts=8)
    c.visit(0, keys)
    put(c, table, 1, keys[1])
    assert c.victim() == 0  # empty, though slot 1 was touched later and its expert is this call's
    put(c, table, 0, keys[0])
    table.evict(0, 1)
    assert c.victim() == 1


def test_the_victim_is_never_held_nor_reserved():
    keys = [ExpertKey(0, e) for e in range(4)]
    c, table = cache_over(keys, 3, experts=8)
    c.visit(0)
    for s in range(3):
        put(c, table, s, keys[s])
    c.visit(0)  # a new call: none of them is protected
    assert c.victim() == 0  # equal waits: the least recently used
    table.hold(0, 0)
    assert c.victim() == 1
    table.reserve(0, 1, "stream")
    assert c.victim() == 2
    table.hold(0, 2)
    assert c.victim() is None, "every slot held or reserved"
    table.release(0, 0, None)
    assert c.victim() == 0
    table.unreserve(0, 1, "stream", None, keep=False)
    assert c.victim() == 1, "an empty slot before an occupied one"
    assert c.victim() == 1, "victim() itself changes nothing"


def test_equal_waits_go_least_recently_used_first():
    keys = [ExpertKey(0, e) for e in range(3)]
    c, table = cache_over(keys, 3, experts=8)
    c.visit(0)
    for s in (2, 0, 1):
        put(c, table, s, keys[s])
    c.visit(0)
    assert c.victim() == 2
    c.touch(2)
    assert c.victim() == 0
    c.touch(0)
    assert c.victim() == 1


# -- the layer-aware forecast (the Markov policy's fallback where a layer's states do not differ) -----
def test_the_forecast_evicts_the_layer_called_last_on_a_cycle():
    """Layers 0, 1, 2 in a cycle, one expert each used every call: after layer 2's call, layer 0's
    expert is needed next and layer 2's last (LRU would evict layer 0's: the one needed next)."""
    keys = [ExpertKey(L, 0) for L in range(3)]
    c, table = cache_over(keys, 2, layers=[0, 1, 2], experts=8)
    for _ in range(5):
        for k in keys:
            c.visit(k.layer)
            c.access(k)
    assert not any(c.chained.values()), "no chain: the forecast decides"
    put(c, table, 0, keys[0])
    put(c, table, 1, keys[1])  # slot 0 is the least recently used: LRU would pick it
    c.visit(2, [keys[2]])  # layer 2 is being called now; its expert (not cached) needs a slot
    c.access(keys[2])
    assert c.wait(keys[1]) > c.wait(keys[0])
    assert c.victim() == 1  # layer 1's expert waits two calls longer than layer 0's


def test_the_forecast_keeps_the_popular_expert_of_a_layer():
    hot, rare = ExpertKey(0, 0), ExpertKey(0, 1)
    c, _ = cache_over([hot, rare], 1, experts=8)
    for i in range(40):
        c.visit(0)
        c.access(hot if i % 10 else rare)
    assert not c.chained.get(0, False)
    assert c.wait(hot) < c.wait(rare)


def test_the_current_call_is_protected():
    keys = [ExpertKey(0, s) for s in range(3)]
    c, table = cache_over(keys + [ExpertKey(1, 5), ExpertKey(1, 6)], 3, layers=[0, 1], experts=8)
    c.visit(0)
    for s in range(3):
        c.access(keys[s])
        put(c, table, s, keys[s])
    assert c.wait(keys[1]) == -1.0
    c.visit(1, [ExpertKey(1, 5), ExpertKey(1, 6)])
    c.access(ExpertKey(1, 5))
    assert c.wait(ExpertKey(1, 5)) == c.wait(ExpertKey(1, 6)) == -1.0  # known users of the call, looked up or not
    assert c.wait(keys[1]) > 0


@pytest.mark.parametrize("shape", [(8, 8, 2, 400), (6, 32, 4, 120)])
def test_the_policy_keeps_most_of_beladys_hits_on_the_skewed_trace(shape):
    """The replay numbers the docs quote come from the same code: at least 0.85 of Belady's hits
    on skewed, sticky routing (LRU thrashes on the layer cycle)."""
    layers, experts, k, tokens = shape
    seq = lookups(TraceModel(layers, experts, k, zipf_s=1.2, reuse_p=0.5, seed=0).sample(tokens), list(range(layers)))
    cap = layers * experts // 4
    assert replay(seq, cap, set()) >= 0.85 * belady_hits(seq, cap, set())


class Ungated(SlotCache):
    """The chain used for every layer (``experts`` unknown)."""

    def __init__(self, table, pool, slots, layers, experts):
        super().__init__(table, pool, slots, layers, None)


class ForecastOnly(SlotCache):
    """The fallback alone: the larger of the fast and the slow moving average, for every layer."""

    def chance(self, key):
        return max(self._averages(key))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=120),
       st.integers(1, 4), st.sampled_from([None, 6]))
def test_the_victim_is_the_largest_wait(raw, capacity, experts):
    """The inlined victim choice (with waits kept within a call) equals max(free, key=wait), ties
    to the least recently used; with the chain always used (``experts`` unknown) and gated. An
    entry with ``ahead == 0`` is a read-ahead during the current call: the next layer's expert
    staged without a lookup."""
    keys = [ExpertKey(L, e) for L in range(3) for e in range(6)]
    c, table = cache_over(keys, capacity, layers=[0, 1, 2], experts=experts)

    def stage(key):
        if all(table.occupant(0, s) is not None for s in range(capacity)):
            want = max(c._order, key=lambda s: c.wait(table.occupant(0, s)))
            assert c.victim() == want
            assert c.victim() == want  # again, from the waits kept within the call
        put(c, table, c.victim(), key)

    current = None
    for layer, e, ahead in raw:
        if ahead == 0 and current is not None:
            key = ExpertKey((current + 1) % 3, e)
            if table[key].slot is None:
                stage(key)
            continue
        key = ExpertKey(layer, e)
        if layer != current:
            c.visit(layer, [key])
            current = layer
        c.access(key)
        if table[key].slot is not None:
            c.touch(table[key].slot)
            continue
        stage(key)


# -- the chance per state (the Markov chain) ------------------------------------------------------
def test_the_chain_counts_each_expert_apart_for_the_two_states():
    """Exact counts on a hand-made run of one layer (no lookups: the popularity prior is 0)."""
    c, _ = cache_over([ExpertKey(0, e) for e in range(6)], 2)
    P = c.PRIOR
    for used in ({0, 1}, {0, 2}, {0, 1}, {0, 3}):
        c.visit(0, [ExpertKey(0, e) for e in sorted(used)])
    # expert 0: used at all 4 calls -> 3 of 3 kept; the layer kept 3 of its 6 chances: reuse (3+1)/(6+2)
    assert c.chance(ExpertKey(0, 0)) == pytest.approx((3 + P * 0.5) / (3 + P))
    # expert 1: its last call did not use it; of the 3 - 2 calls after one that did not, 1 used it
    assert c.chance(ExpertKey(0, 1)) == pytest.approx(1 / (3 - 2 + P))
    assert c.chance(ExpertKey(0, 2)) == pytest.approx(1 / (3 - 1 + P))
    assert c.chance(ExpertKey(0, 5)) == 0.0  # never used, no popularity yet
    assert c.chance(ExpertKey(0, 3)) == pytest.approx((0 + P * 0.5) / (0 + P))  # just used: the layer's reuse rate


def test_the_chains_prior_is_the_forecasts_popularity():
    """Lookups feed the slow average, the prior of an expert with no transitions yet."""
    key = ExpertKey(0, 7)
    c, _ = cache_over([key], 1)
    P = c.PRIOR
    c.visit(0, [key])
    c.access(key)
    c.visit(0, [])
    _, slow = c._averages(key)
    assert slow > 0
    assert c.chance(key) == pytest.approx((0 + P * slow) / (1 - 1 + P))
    c.visit(0, [key])  # used again: the used state's prior is the layer's reuse rate plus the rest times popularity
    c.access(key)
    _, slow = c._averages(key)
    reuse = (0 + 1) / (1 + 2)  # 0 kept of the 1 chance so far (expert 7, from the first call to the second)
    assert c.chance(key) == pytest.approx((0 + P * (reuse + (1 - reuse) * slow)) / (1 + P))  # 0 of 1 kept: na = 1


def test_the_chain_keeps_most_of_beladys_hits_where_experts_are_many():
    """Skewed, sticky routing with many experts per layer (64, top-8): the per-state chances keep
    at least 0.92 of Belady's hits, more than the forecast alone."""
    seq = lookups(TraceModel(6, 64, 8, zipf_s=1.2, reuse_p=0.5, seed=0).sample(150), list(range(6)))
    cap = 6 * 64 // 4
    hits = replay(seq, cap, set())
    assert hits >= 0.92 * belady_hits(seq, cap, set())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slot_cache, "SlotCache", ForecastOnly)
        assert hits > replay(seq, cap, set())


def test_the_chain_is_used_only_where_a_layers_two_states_differ():
    """With ``experts`` known, a layer whose reuse rate and fresh-use rate do not differ by
    ``SIGNIFICANCE`` standard errors (uniform routing) gets the forecast's chances; a sticky one
    (each call keeps the last call's experts) gets the chain's."""
    rng = torch.Generator().manual_seed(0)
    keys = [ExpertKey(L, e) for L in (0, 1) for e in range(16)]
    c, _ = cache_over(keys, 4, layers=[0, 1], experts=16)
    for _ in range(60):
        for layer in (0, 1):
            if layer == 0:  # uniform: 2 of 16 at random
                used = torch.randperm(16, generator=rng)[:2].tolist()
            else:  # sticky: always experts 3 and 4
                used = [3, 4]
            ks = [ExpertKey(layer, e) for e in used]
            c.visit(layer, ks)
            for k in ks:
                c.access(k)
    assert c.chained[0] is False and c.chained[1] is True
    assert c.fresh[1] == (0, 59 * (16 - 2)) and c.kept[1] == (59 * 2, 59 * 2)  # nothing fresh, all kept
    uniform = ExpertKey(0, next(iter(c.last[0])))
    assert c.chance(uniform) == max(c._averages(uniform))  # the forecast's chance
    sticky = ExpertKey(1, 3)
    na, ha = c._na[1][3], c._ha[1][3]
    kept, chances = c.kept[1]
    reuse = (kept + 1) / (chances + 2)
    prior = reuse + (1 - reuse) * c._averages(sticky)[1]
    assert c.chance(sticky) == pytest.approx((ha + c.PRIOR * prior) / (na + c.PRIOR))
    ungated, _ = cache_over(keys, 4, layers=[0, 1])  # experts unknown: always the chain
    ungated.visit(0, [uniform])
    ungated.visit(0, [uniform])
    reuse = (1 + 1) / (1 + 2)  # kept 1 of 1; no lookups, so no popularity
    assert not ungated.chained and ungated.chance(uniform) == pytest.approx((1 + ungated.PRIOR * reuse) / (1 + ungated.PRIOR))


def test_on_uniform_routing_the_gated_chain_keeps_exactly_the_forecasts_hits(monkeypatch):
    """The replay numbers the docs quote: on uniform routing with Mixtral's counts the gated chain
    (what ``replay`` runs) falls back to the forecast everywhere and keeps exactly its hits, where
    the ungated one loses some."""
    seq = lookups(TraceModel(8, 8, 2, seed=0).sample(256), list(range(8)))
    gated = replay(seq, 16, set())
    monkeypatch.setattr(slot_cache, "SlotCache", ForecastOnly)
    forecast = replay(seq, 16, set())
    monkeypatch.setattr(slot_cache, "SlotCache", Ungated)
    ungated = replay(seq, 16, set())
    assert gated == forecast > ungated


def test_an_expert_looked_up_after_a_choice_in_the_same_call_is_protected():
    """Waits are kept within a call, but an expert the call looks up after a victim was chosen
    is protected from then on: its kept wait must not count."""
    A, B, C, X, Y = ExpertKey(0, 2), ExpertKey(0, 1), ExpertKey(0, 3), ExpertKey(1, 0), ExpertKey(1, 1)

    class Fixed(SlotCache):
        def chance(self, key):
            return {B: 0.1, X: 0.01, Y: 0.9}.get(key, 0.5)

    c, table = cache_over([A, B, C, X, Y], 3, layers=[0, 1], cls=Fixed)
    c.visit(0, [B])
    c.access(B)
    put(c, table, 0, B)
    c.visit(1, [X, Y])
    put(c, table, 1, X)
    put(c, table, 2, Y)
    c.visit(0, [A])  # B is not announced: it is looked up later in the call
    c.access(A)
    assert c.victim() == 1  # X waits longest (B's wait, 2 + 2 * 9, is kept)
    put(c, table, 1, A)
    c.access(B)  # a hit
    c.access(C)
    assert c.victim() == 2  # Y: A and B are this call's


def test_kept_waits_match_fresh_ones_after_a_read_ahead_in_the_call():
    """A slot rewritten mid-call by a read-ahead (not a key of the call) gets a fresh wait, while
    the others keep theirs: the choice must be the one fresh waits would give."""
    A, B, C, R, X, Y = (ExpertKey(1, 0), ExpertKey(1, 1), ExpertKey(1, 3), ExpertKey(1, 2), ExpertKey(0, 5), ExpertKey(0, 6))

    class Fixed(SlotCache):
        def chance(self, key):
            return {A: 0.1, B: 0.5, C: 0.08, R: 0.12}.get(key, 0.9)

    c, table = cache_over([A, B, C, R, X, Y], 3, layers=[0, 1], cls=Fixed)
    c.visit(1, [A, B, C])
    for slot, key in enumerate((A, B, C)):
        put(c, table, slot, key)
    c.visit(0, [X, Y])
    c.access(X)
    assert c.victim() == 2  # C waits 1 + 2 * 11.5 = 24, A 19, B 3; all three are kept now
    put(c, table, 2, R)  # a read-ahead of layer 1 takes C's slot: R waits 1 + 2 * (1/0.12 - 1), about 15.7
    c.access(Y)
    fresh = max((0, 1, 2), key=lambda s: c.wait(table.occupant(0, s)))
    assert c.victim() == fresh == 0  # A's kept 19 still beats R's fresh 15.7
