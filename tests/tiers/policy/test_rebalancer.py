"""The rebalancer (tiers.policy.rebalancer): plans carried out on a loaded model.

Most tests drive a ``Manager`` on the CPU over a packed tiny Mixtral with every tier in bf16, so
any expert served from any tier, before or after a move, must equal its packed weights exactly.
Calls are driven as the host-routed paths make them (rebalancer_helpers.py: ``drive``), and after
every rebalance and every landing the table's invariants are checked (``checked``). Whole-model
runs with the rebalancer on are tested in test_rebalancer_generate.py.

``margin`` and ``significance`` are module constants now (no config key): tests that need moves
on small counts plan with both at 0 (the ``plans_move_on_any_gain`` fixture, what the old tests'
config gave), and one test checks the rebalancer plans with the constants themselves.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiers
from rebalancer_helpers import K, check_held, drive, hot_keys, manager, plan_on_any_gain, read_truth, skewed_calls, warm_count
from tiers import report
from tiers.policy import rebalance, rebalancer
from tiers.store.disk_store import IntegrityError
from tiers.store.table import Home

from tier_fakes import Recorder, RecordingStreams  # tests/tier_fakes.py


@pytest.fixture(autouse=True)
def plans_move_on_any_gain(monkeypatch):
    """The rebalancer plans with margin 0 and significance 0 (tiny models count few lookups; the
    plan's thresholds are tests/tiers/policy/test_rebalance.py's)."""
    plan_on_any_gain(monkeypatch)


@pytest.fixture
def truth(packed_factory):
    return read_truth(packed_factory("mixtral"))


# -- promotions, budgets ------------------------------------------------------------------------
def test_frequent_experts_become_hot_and_warm_exactly(packed_factory, truth):
    mgr = manager(packed_factory("mixtral"), every=4)
    hot0 = hot_keys(mgr)
    warm0 = warm_count(mgr)
    used0, parts0, gpu0 = mgr.host.used, dict(mgr.host.parts), report.gpu_bytes(mgr)
    per_layer0 = Counter(k.layer for k in hot0)
    favourite = {L: next(e for e in range(7, -1, -1) if not mgr.table[K(L, e)].hot) for L in range(3)}
    drive(mgr, skewed_calls(24, favourite), truth)
    mgr.rebalancer.land(wait=True)
    drive(mgr, skewed_calls(8, favourite), truth)  # serve again after the swaps
    hot = hot_keys(mgr)
    assert {K(L, e) for L, e in favourite.items()} <= hot, "the favourites were promoted"
    assert len(hot) == len(hot0), "the hot set keeps its slot count"
    assert Counter(k.layer for k in hot) == per_layer0, "each layer keeps its hot count (own-layer moves)"
    assert warm_count(mgr) == warm0, "the warm set keeps its size"
    assert mgr.host.used == used0 and mgr.host.parts == parts0, "the host pool never grows"
    assert report.gpu_bytes(mgr) == gpu0, "the gpu budget holds"
    s = report.stats(mgr)
    assert s.rebalance["promoted_hot"] >= 3 and s.rebalance["rebalances"] >= 5
    assert s.bytes_moved["rebalance"] > 0
    assert s.residency["gpu"]["experts"] == len(hot)
    mgr.table.check()  # the table's invariants after many moves
    for k, r in mgr.table.items():
        assert r.hot == (r.home is Home.GPU)
        assert (r.home is Home.CPU) == (r.host_offset is not None)
    offsets = [r.host_offset for _, r in mgr.table.items() if r.host_offset is not None]
    assert len(offsets) == len(set(offsets)), "two warm experts share host bytes"
    mgr.close()


def test_the_rebalancer_plans_with_the_constants(packed_factory, monkeypatch):
    """Without the fixture's thresholds: a newcomer counted 5 times against unused hot experts is
    noise (5 < 3 * sqrt(5)), counted 20 times it is promoted (20 >= 3 * sqrt(20) = 13.4)."""
    monkeypatch.setattr(rebalancer, "plan_moves", rebalance.plan_moves)
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    rb = mgr.rebalancer
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].hot)
    rb.window.count([newcomer] * 5)
    assert rb.rebalance(rb.window.frequency()) == []
    rb.window.count([newcomer] * 15)
    moves = rb.rebalance(rb.window.frequency())
    assert [(m.key, m.to) for m in moves] == [(newcomer, Home.GPU)] and moves[0].replaces.layer == 0
    rb.land(wait=True)
    assert mgr.table[newcomer].hot and not mgr.table[moves[0].replaces].hot
    mgr.close()


def test_a_newcomer_takes_a_hot_slot_of_its_own_layer(packed_factory, truth):
    """Layer 0's hot experts are used, the other layers' not: a newcomer of layer 0 still replaces
    one of layer 0's own, whose slot it takes (every layer keeps its hot count and its slots)."""
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    hot_of = lambda: Counter(k.layer for k in hot_keys(mgr))  # noqa: E731
    slots_of = lambda L: sorted(r.slot for k, r in mgr.table.items() if r.hot and k.layer == L)  # noqa: E731
    before, slots = hot_of(), {L: slots_of(L) for L in range(3)}
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].hot)
    mgr.rebalancer.window.count([newcomer] * 20 + [k for k in hot_keys(mgr) if k.layer == 0] * 3)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].hot
    assert hot_of() == before and {L: slots_of(L) for L in range(3)} == slots
    drive(mgr, [(0, [newcomer.expert])], truth)
    mgr.close()


def test_a_held_hot_slot_is_not_swapped_until_released(packed_factory, truth):
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    victim = min((k for k in hot_keys(mgr) if k.layer == 0), key=lambda k: k.expert)
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].hot)
    held = mgr.slots.acquire_layer(0, [victim.expert])  # the victim's slot is held
    mgr.rebalancer.window.count([newcomer] * 5)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert mgr.table[victim].hot, "swapped while held"
    assert newcomer in mgr.rebalancer.hot_reads
    check_held(mgr, held, truth)  # still its own weights, then released
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].hot and not mgr.table[victim].hot
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
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].hot)
    rb.window.count([newcomer] * 20)
    assert rb.rebalance(rb.window.frequency()) == [] and not rb.hot_reads
    queued[-1].done = True  # one buffer's copy up has run: that one is free
    moves = rb.rebalance(rb.window.frequency())
    assert [m.key for m in moves] == [newcomer] and [r.buffer for r in rb.hot_reads.values()] == [len(rb.buffers) - 1]
    rb.land(wait=True)
    assert mgr.table[newcomer].hot
    drive(mgr, [(0, [newcomer.expert])], truth)
    mgr.close()


# -- ordering on the streams (recorded: tests/tier_fakes.py) ------------------------------------
def test_hot_swap_forks_the_compute_stream_before_the_copy(packed_factory):
    """The outgoing hot slot has no last-read event: the copy stream must wait on an event
    recorded on the compute stream at the swap, before the copy into the slot is queued."""
    rec = Recorder()
    streams = RecordingStreams(rec)
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1, streams=streams)
    copy_stream = mgr.staging.copy_stream
    assert copy_stream in streams.made
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].hot)
    mgr.rebalancer.window.count([newcomer] * 5)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    for r in mgr.rebalancer.hot_reads.values():  # the reads have landed; what follows is the swap's alone
        r.future.result(), r.out_future.result()
    swap = len(rec.order)
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].hot
    order = rec.order[swap:]
    fork = next(i for i, o in enumerate(order) if o[0] == "record" and o[1] is streams.compute)
    waits = [i for i, o in enumerate(order) if o[0] == "wait" and o[1] is copy_stream and o[2] is order[fork][2]]
    uses = [i for i, o in enumerate(order) if o[0] == "use" and o[1] is copy_stream]
    assert waits and uses and fork < waits[0] < uses[-1]
    mgr.close()


def test_a_host_place_is_refilled_only_after_every_queued_read_of_it(packed_factory, monkeypatch):
    """Direct decode kernels read warm places on the compute stream, copies and direct stacks on
    the copy stream: the fence a rebalance read waits on before refilling a place is recorded on
    the copy stream after it waited on an event recorded on the compute stream. The fence is a
    blocking event: the rebalance thread sleeps while it waits, behind a prefill's reads at times,
    instead of spinning a core the serving thread may need."""
    rec = Recorder()
    streams = RecordingStreams(rec)
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1, streams=streams)
    copy_stream = mgr.staging.copy_stream
    fences = []
    read_after = mgr.rebalancer._read_after
    monkeypatch.setattr(mgr.rebalancer, "_read_after", lambda fence, *a: fences.append(fence) or read_after(fence, *a))
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].hot)
    mgr.rebalancer.window.count([newcomer] * 5)
    start = len(rec.order)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert fences, "the swap must refill a place (the demoted expert's cpu blob)"
    order = rec.order[start:]
    for fence in fences:
        assert fence.blocking, "a rebalance thread's fence must not spin"
        at = next(i for i, o in enumerate(order) if o[0] == "record" and o[2] is fence)
        assert order[at][1] is copy_stream
        compute = [o[2] for o in order[:at] if o[0] == "record" and o[1] is streams.compute]
        assert any(o[0] == "wait" and o[1] is copy_stream and o[2] is ev for ev in compute for o in order[:at])
        synced = next(i for i, o in enumerate(order) if o[0] == "sync" and o[2] is fence)
        assert synced > at, "the read waits for its fence"
    mgr.close()


# -- failed reads, demotions, relocations ----------------------------------------------------------
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
    mgr.rebalancer.window.count([cold] * 9 + sorted(hot_keys(mgr)) * 20)  # hot stays hot
    moves = mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    assert any(m.key == cold and m.to is Home.CPU for m in moves)
    mgr.rebalancer.land(wait=True)
    assert mgr.table[cold].home is Home.NVME
    assert report.stats(mgr).rebalance["read_errors"] == 1
    replaced = [k for k in warm if mgr.table[k].home is Home.NVME]
    assert replaced, "the warm move took a warm expert's place"
    assert len(mgr.rebalancer.free_places[mgr.pool_of[cold.layer].index]) == len(replaced), "its place is free again"
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


@pytest.mark.parametrize("fail_out", [False, True])
def test_a_demoted_hot_expert_is_warm_at_once(packed_factory, truth, monkeypatch, fail_out):
    """The outgoing expert's cpu blob is read before the swap, so it never becomes a disk read on
    the serving path; if that read fails it lives on disk (still served exactly)."""
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    victim = min((k for k in hot_keys(mgr) if k.layer == 0), key=lambda k: k.expert)
    newcomer = next(K(0, e) for e in range(8) if mgr.table[K(0, e)].home is Home.NVME)
    warm0 = warm_count(mgr)
    real = mgr.disk.read

    def read(key, precision, out):
        if fail_out and key == victim:
            raise IntegrityError(f"checksum mismatch for {key}")
        return real(key, precision, out)

    monkeypatch.setattr(mgr.disk, "read", read)
    others = sorted(k for k in hot_keys(mgr) if k != victim)
    mgr.rebalancer.window.count([newcomer] * 5 + others * 20)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    mgr.rebalancer.land(wait=True)
    assert mgr.table[newcomer].hot
    assert mgr.table[victim].home is (Home.NVME if fail_out else Home.CPU)
    assert report.stats(mgr).rebalance["read_errors"] == int(fail_out)
    # a newcomer from disk: the least used warm expert was cooled, so the warm set keeps its size
    assert warm_count(mgr) == warm0
    monkeypatch.setattr(mgr.disk, "read", real)
    before = report.stats(mgr).hits
    drive(mgr, [(0, [victim.expert])], truth)
    after = report.stats(mgr).hits
    assert after["nvme" if fail_out else "cpu"] == before["nvme" if fail_out else "cpu"] + 1
    mgr.close()


def test_swaps_land_between_forwards_only(packed_factory, truth):
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    assert mgr.first_layer == 0
    newcomer = next(K(0, e) for e in range(8) if not mgr.table[K(0, e)].hot)
    mgr.rebalancer.window.count([newcomer] * 5 + sorted(k for k in hot_keys(mgr) if k.layer != 0) * 20)
    mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
    for r in mgr.rebalancer.hot_reads.values():
        r.future.result(), r.out_future.result()  # the reads have landed
    drive(mgr, [(1, [0, 1]), (2, [3])], truth)  # later layers of a forward: nothing is swapped
    assert not mgr.table[newcomer].hot and mgr.rebalancer.hot_reads
    drive(mgr, [(0, [5])], truth)  # the next forward begins
    assert mgr.table[newcomer].hot
    mgr.table.check()
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
    reader threads (as once ``close`` has shut them down) the reads and the copy run on the
    serving thread."""
    mgr = manager(packed_factory("mixtral"), every=1, max_moves=1)
    rb = mgr.rebalancer
    assert rb.pool is not None and rb.pool._max_workers == 2
    if not threads:
        rb.pool.shutdown(wait=True)
        rb.pool = None
    newcomer = next(K(0, e) for e in range(8) if mgr.table[K(0, e)].home is Home.CPU)
    place = mgr.table[newcomer].host_offset
    spares0 = sorted(o for sp in rb.spares.values() for o in sp)
    rb.window.count([newcomer] * 5 + sorted(k for k in hot_keys(mgr) if k.layer != 0) * 20)
    victim = next(iter(rb.rebalance(rb.window.frequency()))).replaces
    assert victim.layer == 0
    rb.land(wait=True)
    assert mgr.table[newcomer].hot and mgr.table[victim].host_offset == place
    assert sorted(o for sp in rb.spares.values() for o in sp) == spares0 and not rb.relocations
    drive(mgr, [(0, [victim.expert])], truth)  # served exactly from its new place
    assert report.stats(mgr).hits["cpu"] >= 1
    mgr.close()


# -- the whole manager under random calls, rebalances and landings ---------------------------------
engine_steps = st.lists(
    st.one_of(
        st.tuples(st.just("call"), st.integers(0, 2), st.sets(st.integers(0, 7), min_size=1, max_size=4)),
        st.tuples(st.just("favour"), st.integers(0, 2), st.integers(0, 7)),
        st.tuples(st.just("rebalance"), st.booleans()),  # True: wait for every read first
        st.tuples(st.just("land"),),  # land what has finished, waiting for nothing
    ),
    min_size=1, max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # truth is read-only
@given(steps=engine_steps)
def test_random_calls_and_moves_keep_every_invariant(packed_factory, truth, steps):
    """Calls serve exact weights; every layer keeps its hot count, the warm set at most its size,
    no two warm experts share bytes and no host place leaks, the table's invariants hold, and no
    slot stays held but by a read-ahead in flight."""
    mgr = manager(packed_factory("mixtral"), every=10**6, max_moves=2)  # rounds only when the test says
    hot0 = Counter(k.layer for k in hot_keys(mgr))
    warm0 = warm_count(mgr)
    places0 = sorted([r.host_offset for _, r in mgr.table.items() if r.host_offset is not None] + _free_places(mgr.rebalancer))
    try:
        for step in steps:
            if step[0] == "call":
                _, layer, experts = step
                drive(mgr, [(0, [0])] if layer else [], truth)  # a forward starts at the first layer
                drive(mgr, [(layer, sorted(experts))], truth)
            elif step[0] == "favour":
                mgr.rebalancer.window.count([K(step[1], step[2])] * 7)
            elif step[0] == "land":
                mgr.rebalancer.land()
            else:
                mgr.rebalancer.rebalance(mgr.rebalancer.window.frequency())
                if step[1]:
                    mgr.slots.drain()
                    mgr.rebalancer.land(wait=True)
            mgr.table.check()
            table = dict(mgr.table.items())
            assert Counter(k.layer for k, r in table.items() if r.hot) == hot0
            assert sum(r.home is Home.CPU for r in table.values()) <= warm0
            offsets = [r.host_offset for r in table.values() if r.host_offset is not None]
            assert len(offsets) == len(set(offsets))
            assert sorted(offsets + _free_places(mgr.rebalancer)) == places0, "a host place leaked or is held twice"
            for k, r in table.items():
                assert r.hot == (r.home is Home.GPU)
                assert (r.home is Home.CPU) == (r.host_offset is not None)
            pending = mgr.slots.read_ahead_pending()
            assert all(x == 0 for p in mgr.pools for s, x in enumerate(mgr.table.readers(p.index)) if (p.index, s) not in pending)
        mgr.slots.drain()
        mgr.rebalancer.land(wait=True)
        drive(mgr, [(L, list(range(8))) for L in range(3)], truth)  # every expert, wherever it lives now
    finally:
        mgr.close()
