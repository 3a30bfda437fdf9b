"""The decision (tiers.paths.dispatch): one test per row of its table and per boundary of each row.

``dispatch`` is a pure function of ``Facts``, first match wins. Each row's test feeds it facts that
also satisfy every later row, so that moving that row below another fails the test; the rows'
boundaries (room, misses, room 1, recording, cold experts, decode against prefill) are each
checked on both sides. The direct row (decode only) and the whole row (prefill only) exclude
each other, so their relative order cannot show, and is not tested.

The second part checks ``Manager.facts``: what a real manager reports about a call before its
routing, which the decision reads (the path objects' own runs are spied on in tests/tiers/test_api.py).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

import tiers
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey
from tiers.paths.dispatch import Facts, Path, dispatch
from tiers.store.table import Home

# a prefill call before its routing that nothing but the rows below it would take
PREFILL = Facts(all_hot=False, decoding=False, direct=False, whole=False, cold=False, recording=False, room=4, layer_misses=0)
# ... and one the whole row takes: long enough, no cold expert in no slot, more misses than half the room
WHOLE = replace(PREFILL, whole=True, layer_misses=3)
DECODE = replace(PREFILL, decoding=True)


def routed(f: Facts, *, need: int, misses: int, picks_known: bool = False) -> Facts:
    return replace(f, routed=True, need=need, misses=misses, picks_known=picks_known)


# -- row 1: every expert hot -> resident ------------------------------------------------------------
@pytest.mark.parametrize("facts", [
    replace(DECODE, direct=True),  # the direct row would match
    WHOLE,  # the whole row would match
    PREFILL,  # the route row would match
    routed(PREFILL, need=0, misses=0, picks_known=True),  # the held row would match
    routed(PREFILL, need=9, misses=9),  # the streamed row would match
], ids=["direct", "whole", "route", "held", "streamed"])
def test_all_hot_is_resident_before_every_other_row(facts):
    assert dispatch(replace(facts, all_hot=True)) is Path.RESIDENT
    assert dispatch(facts) is not Path.RESIDENT


# -- row 2: decode with the direct tables and slots -> direct --------------------------------------
@pytest.mark.parametrize("facts", [
    DECODE,  # the route row would match
    routed(DECODE, need=0, misses=0, picks_known=True),  # the held row would match
    routed(DECODE, need=9, misses=9, picks_known=True),  # the streamed row would match
    replace(DECODE, whole=True, layer_misses=3),  # whole's facts too (decode never takes it)
    replace(DECODE, recording=True, cold=True, room=0),  # recording and cold experts do not bar it (the facts do: no slots are reserved while recording)
], ids=["route", "held", "streamed", "whole_facts", "recording_cold"])
def test_direct_in_decode_before_routing(facts):
    assert dispatch(replace(facts, direct=True)) is Path.DIRECT
    assert dispatch(facts) is not Path.DIRECT


def test_direct_needs_the_decode_stage():
    """The direct facts outside the decode stage (a prefill) leave the call to the rows below."""
    assert dispatch(replace(PREFILL, direct=True)) is Path.ROUTE
    assert dispatch(routed(replace(PREFILL, direct=True), need=1, misses=1, picks_known=True)) is Path.HELD


# -- row 3: a long prefill, its warm experts read whole -> whole -------------------------------------
def test_whole_before_routing_and_before_held_or_streamed():
    assert dispatch(WHOLE) is Path.WHOLE  # the route row (not routed yet) comes after it
    assert dispatch(routed(WHOLE, need=0, misses=0, picks_known=True)) is Path.WHOLE  # ... and the held row
    assert dispatch(routed(WHOLE, need=9, misses=9)) is Path.WHOLE  # ... and the streamed row


@pytest.mark.parametrize("room", [2, 3, 4, 5, 8])
def test_whole_needs_more_misses_than_half_the_room(room):
    assert dispatch(replace(WHOLE, room=room, layer_misses=room // 2)) is Path.ROUTE
    assert dispatch(replace(WHOLE, room=room, layer_misses=room // 2 + 1)) is Path.WHOLE


@pytest.mark.parametrize("room", [0, 1])
def test_whole_needs_two_free_staging_slots(room):
    """Two buffers: with one free staging slot (or none) a long prefill waits for its routing, however many its misses."""
    assert dispatch(replace(WHOLE, room=room, layer_misses=8)) is Path.ROUTE
    assert dispatch(replace(WHOLE, room=2, layer_misses=8)) is Path.WHOLE


@pytest.mark.parametrize("bar", ["decoding", "cold", "recording", "not_whole"])
def test_whole_is_barred_by(bar):
    f = {"decoding": replace(WHOLE, decoding=True), "cold": replace(WHOLE, cold=True), "recording": replace(WHOLE, recording=True),
         "not_whole": replace(WHOLE, whole=False)}[bar]
    assert dispatch(f) is Path.ROUTE
    # once routed, such a call is held or streamed by its own counts
    assert dispatch(routed(f, need=2, misses=2)) is Path.HELD
    assert dispatch(routed(f, need=3, misses=3)) is Path.STREAMED


# -- row 4: the routing is not on the host yet -> route ----------------------------------------------
@pytest.mark.parametrize("facts", [PREFILL, DECODE, replace(PREFILL, room=0), replace(PREFILL, cold=True, recording=True)],
                         ids=["prefill", "decode", "no_room", "cold_recording"])
def test_route_before_held_and_streamed(facts):
    """Before the routing sync the host knows no need or misses (both 0, which the held row would take)."""
    assert dispatch(facts) is Path.ROUTE
    assert dispatch(replace(facts, picks_known=True)) is Path.ROUTE


# -- row 5: the call's experts fit the free staging slots -> held ------------------------------------
@pytest.mark.parametrize("room", [1, 2, 4, 7, 8])
def test_held_needs_its_non_hot_experts_to_fit_the_room(room):
    """need == room is held, need == room + 1 streamed, picks known (every miss a hit or not alike)."""
    assert dispatch(routed(replace(PREFILL, room=room), need=room, misses=room, picks_known=True)) is Path.HELD
    assert dispatch(routed(replace(PREFILL, room=room), need=room + 1, misses=0, picks_known=True)) is Path.STREAMED


@pytest.mark.parametrize("room", [2, 3, 4, 5, 8])
def test_held_prefill_needs_its_misses_to_fit_half_the_room(room):
    """A prefill call (picks not on the host): misses == room // 2 held, room // 2 + 1 streamed, need fitting either way."""
    f = replace(PREFILL, room=room)
    assert dispatch(routed(f, need=room, misses=room // 2)) is Path.HELD
    assert dispatch(routed(f, need=room, misses=room // 2 + 1)) is Path.STREAMED


@pytest.mark.parametrize("room", [2, 4, 8])
def test_held_with_picks_known_ignores_the_half_room_bound(room):
    """Picks on the host (a short call, or decode): misses up to the whole room are held."""
    for f in (replace(PREFILL, room=room), replace(DECODE, room=room)):
        assert dispatch(routed(f, need=room, misses=room, picks_known=True)) is Path.HELD
        assert dispatch(routed(f, need=room, misses=room, picks_known=False)) is Path.STREAMED


def test_held_with_one_staging_slot():
    """room 1: a single non-hot expert is held, its miss included (half the room is 0); two stream."""
    f = replace(PREFILL, room=1)
    assert dispatch(routed(f, need=1, misses=1)) is Path.HELD
    assert dispatch(routed(f, need=1, misses=1, picks_known=True)) is Path.HELD
    assert dispatch(routed(f, need=2, misses=0)) is Path.STREAMED
    assert dispatch(routed(f, need=2, misses=2, picks_known=True)) is Path.STREAMED


def test_held_with_no_room():
    """Every staging slot reserved (room 0): only a call of hot experts alone is held."""
    f = replace(DECODE, room=0)
    assert dispatch(routed(f, need=0, misses=0, picks_known=True)) is Path.HELD
    assert dispatch(routed(f, need=1, misses=0, picks_known=True)) is Path.STREAMED


@pytest.mark.parametrize("flags", [dict(cold=True), dict(recording=True), dict(decoding=True), dict(whole=True, layer_misses=1)],
                         ids=["cold", "recording", "decoding", "whole_facts_short"])
def test_held_and_streamed_read_only_need_misses_and_room(flags):
    """Cold experts, a trace, the decode stage, or whole's facts that fail its own row do not change held against streamed."""
    f = replace(PREFILL, **flags)
    assert dispatch(routed(f, need=4, misses=2)) is Path.HELD
    assert dispatch(routed(f, need=4, misses=3)) is Path.STREAMED
    assert dispatch(routed(f, need=5, misses=0, picks_known=True)) is Path.STREAMED


# -- row 6: otherwise -> streamed ---------------------------------------------------------------------
def test_streamed_is_the_last_row():
    assert dispatch(routed(PREFILL, need=64, misses=64)) is Path.STREAMED
    assert dispatch(routed(DECODE, need=64, misses=64, picks_known=True)) is Path.STREAMED
    assert {dispatch(routed(PREFILL, need=n, misses=m, picks_known=k)) for n in range(6) for m in range(n + 1) for k in (False, True)} \
        == {Path.HELD, Path.STREAMED}, "once routed, every call is held or streamed"


# -- the facts a real manager reports -----------------------------------------------------------------
def _manager(packed_factory, cpu: dict, staging: int = 4, fraction: float = 0.4):
    cfg = {"tiers": {"gpu": {"fraction": fraction, "staging_slots": staging, "graphs": False}, "cpu": cpu | {"precision": "bf16"},
                     "nvme": {"precision": "bf16"}}}
    return manager_of(tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False))


def test_facts_of_an_all_hot_layer(packed_factory):
    mgr = _manager(packed_factory, {"fraction": 0.0}, fraction=1.0)
    for layer in mgr.manifest.layers:
        f = mgr.facts(layer, 64, 2)
        assert f.all_hot and dispatch(f) is Path.RESIDENT


def test_facts_of_a_long_prefill_with_every_expert_warm(packed_factory):
    mgr = _manager(packed_factory, {"budget": "64MiB"})
    layer = next(L for L in mgr.manifest.layers if not mgr.resident.qualifies(L))
    pool = mgr.pool_of[layer]
    f = mgr.facts(layer, 64, 2)
    in_no_slot = sum(mgr.table[ExpertKey(layer, e)].slot is None for e in range(8))
    assert (f.all_hot, f.decoding, f.direct, f.whole, f.cold, f.recording) == (False, False, False, True, False, False)
    assert f.room == len(pool.staging) == 4 and f.layer_misses == in_no_slot > 2 and not f.routed
    assert dispatch(f) is Path.WHOLE
    short = mgr.facts(layer, 32, 2)  # 64 rows: its picks come to the host
    assert not short.whole and short.layer_misses == 0 and dispatch(short) is Path.ROUTE
    mgr.slots.recorded = []
    assert mgr.facts(layer, 64, 2).recording and dispatch(mgr.facts(layer, 64, 2)) is Path.ROUTE
    mgr.slots.recorded = None
    # a reserved staging slot is not room
    s = pool.staging[0]
    mgr.table.reserve(pool.index, s, "test")
    assert mgr.facts(layer, 64, 2).room == 3
    mgr.table.unreserve(pool.index, s, "test", None, keep=False)


def test_facts_of_a_long_prefill_with_cold_experts(packed_factory):
    mgr = _manager(packed_factory, {"fraction": 0.2})
    layer = next(L for L in mgr.manifest.layers if any(mgr.table[ExpertKey(L, e)].home is Home.NVME for e in range(8)))
    f = mgr.facts(layer, 64, 2)
    assert f.whole and f.cold and dispatch(f) is Path.ROUTE


def test_facts_in_the_decode_stage(packed_factory):
    """In generate's decode stage (forced on the CPU) the whole row is off, and the room is the
    staging slots direct decode left to host-routed calls."""
    mgr = _manager(packed_factory, {"budget": "64MiB"})
    layer = next(L for L in mgr.manifest.layers if not mgr.resident.qualifies(L))
    pool = mgr.pool_of[layer]
    mgr.phase.decoding = True
    try:
        f = mgr.facts(layer, 64, 2)
        assert f.decoding and not f.whole and not f.direct and f.room == mgr.direct.room(pool) == 4
        assert dispatch(f) is Path.ROUTE
        mgr.staging.direct_reads = mgr.direct.enabled = True  # the CPU reference of the kernel
        mgr.begin_decode()
        f = mgr.facts(layer, 1, 2)
        assert f.direct and dispatch(f) is Path.DIRECT
        assert not mgr.facts(layer, 3, 2).direct, "6 picks, 4 reserved slots"
        mgr.end_decode()
        assert not mgr.facts(layer, 1, 2).direct
    finally:
        mgr.phase.decoding = False
