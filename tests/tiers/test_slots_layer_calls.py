"""The slot rule through layer calls: a slot is never rewritten while a reader may still use it.

The first part runs a CPU ``Manager`` over a packed tiny Mixtral with all three tiers in bf16 on
recording streams (``slots_helpers.build``) and drives layer calls (``acquire_layer``, with its
parallel read-ahead of cold misses and injected checksum failures); it checks from the recorded
order that each slot rewrite was queued after the slot's last read, each first use after its copy,
and each disk read into a ring buffer after the host synced on the buffer's previous copy.

The second part makes calls through a loaded model: a call that does not fit, a kernel that
raises while its slots are held, a cached staging slot, and more misses than staging slots.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slots_helpers import Harness, World, assert_holds, build, fractions, load_world
from tier_fakes import index_of_record
import tiers
from tiers import report
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey
from tiers.store.disk_store import IntegrityError
from tiers.store.table import SlotState


@pytest.fixture(scope="module")
def world(packed_factory, checkpoint_factory) -> World:
    """Every expert's bf16 weights, read through transformers from the source checkpoint (not the pack)."""
    return load_world(packed_factory, checkpoint_factory)


# =============================================================================================
# Layer calls, checked against the recorded order
# =============================================================================================
def covered(order, at: int, before: int, stream) -> bool:
    """Whether ``stream`` waited, within ``order[at + 1 : before]``, on the event recorded at ``at`` or on
    a later one of the same stream (a stream runs in order: waiting on a later event covers it)."""
    on = order[at][1]
    return any(o[0] == "wait" and o[1] is stream and index_of_record(order, o[2]) >= at and order[index_of_record(order, o[2])][1] is on
               for o in order[at + 1 : before])


def check_write_ordering(h: Harness) -> int:
    """Every rewrite of a slot that was read before: the copy stream waited on that slot's latest
    last-read event after it was recorded and before the new bytes were written. Returns how many
    writes needed such a wait (so callers can see the check was not vacuous)."""
    order, copy = h.rec.order, h.mgr.staging.copy_stream
    checked = 0
    for pi, slot, key, _, begin, use, _ in h.writes:
        prior = [(e, i) for e, i in h.releases.get((pi, slot), []) if i < begin]
        if not prior:
            continue
        lr, i_rec = prior[-1]
        checked += 1
        assert covered(order, i_rec, use, copy), (
            f"slot {slot} was rewritten with {key} without the copy stream first waiting on its last-read event {lr} (or a later one of its stream)"
        )
    return checked


def check_ring_ordering(h: Harness) -> int:
    """A cold expert is read from disk into its slot's pinned ring buffer only after the host synced on
    the previous copy out of that buffer (the previous disk write through the same slot)."""
    order = h.rec.order
    last_ring: dict = {}
    checked = 0
    for pi, slot, key, source, begin, use, ready in h.writes:
        assert ready is not None, f"write of {key} into slot {slot} was queued but never given a ready event"
        if source != "nvme":
            continue
        reads = [i for i in range(use) if order[i][0] == "disk_read" and order[i][2] == key]
        assert reads, f"{key}: staged from nvme without a disk read"
        prev = last_ring.get((pi, slot))
        if prev is not None:
            checked += 1
            lo = index_of_record(order, prev) + 1
            assert reads[-1] > lo, f"{key}: its disk read came before the previous copy out of slot {slot}'s ring"
            assert any(o[0] == "sync" and o[2] is prev for o in order[lo : reads[-1]]), (
                f"{key}: ring buffer of slot {slot} refilled from disk before the host synced on its previous copy {prev}"
            )
        last_ring[(pi, slot)] = ready
    return checked


def check_consistent(h: Harness, hot_keys: set) -> None:
    """Between layer calls: no slot is held, the table's invariants hold, and every slot's occupant sits there."""
    mgr = h.mgr
    mgr.table.check()
    for pool in mgr.pools:
        assert all(c == 0 for c in mgr.table.readers(pool.index)), f"readers leaked: {mgr.table.readers(pool.index)}"
        for s in range(pool.n_slots):
            k = mgr.table.occupant(pool.index, s)
            if k is not None:
                assert mgr.table[k].slot == s, f"slot {s} names {k}, the table says {mgr.table[k]}"
    for k, r in mgr.table.items():
        assert r.hot == (k in hot_keys)


def check_call(h: Harness, world: World, held: list, hot_slots: set) -> None:
    """After ``wait_all``: every held expert is exactly its own weights, in its own slot, which the
    compute stream waited on (or on a later write of the same stream) after its copy."""
    mgr, order, compute, truth = h.mgr, h.rec.order, h.streams.compute, world.truth
    assert len({(x.pool.index, x.slot) for x in held}) == len(held), "two holders share one slot"
    for x in held:
        pi = x.pool.index
        assert mgr.table.occupant(pi, x.slot) == x.key and mgr.table[x.key].slot == x.slot
        assert mgr.table.state(pi, x.slot) is SlotState.IN_USE
        assert_holds(x.tensors, truth[x.key], f"held {x.key} (slot {x.slot})")
        if x.slot in hot_slots:
            assert mgr.table[x.key].hot
            continue
        ev = h.ready.get((pi, x.slot))
        assert ev is not None, f"staging slot {x.slot} held without ever being written"
        assert covered(order, index_of_record(order, ev), len(order), compute), (
            f"{x.key}: the compute stream did not wait on slot {x.slot}'s ready event {ev} (or a later one of its stream) before use")


def run_scenario(world: World, staging: int, n_hot: int, n_warm: int, calls) -> int:
    manifest = world.manifest
    n = len(manifest.keys)
    h = build(manifest, staging, *fractions(manifest, staging, n_hot, n_warm))
    mgr = h.mgr
    p = mgr.placement
    hot_keys, warm_keys, cold_keys = set(p.hot), set(p.warm), set(p.cold)
    assert (len(hot_keys), len(warm_keys), len(cold_keys)) == (n_hot, n_warm, n - n_hot - n_warm), "all three tiers in use"
    (pool,) = mgr.pools
    assert pool.n_slots == n_hot + staging
    hot_slots = set(range(n_hot))
    raised = False
    try:
        for layer, experts, fail in calls:
            need = sum(not mgr.table[ExpertKey(layer, e)].hot for e in experts)
            h.fail_key = ExpertKey(layer, experts[fail % len(experts)]) if fail is not None and experts else None
            failed_before = h.failed_reads
            try:
                held = mgr.slots.acquire_layer(layer, experts)
            except IntegrityError:
                assert h.failed_reads == failed_before + 1, "an IntegrityError nobody injected"
                raised = True
                mgr.slots.drain()  # the call's other read-aheads land (they hold their slots until then)
                assert mgr.table[h.fail_key or ExpertKey(layer, experts[fail % len(experts)])].slot is None
            else:
                if need > staging:
                    assert held is None, "more misses than staging slots cannot be held at once"
                else:
                    assert held is not None and [x.key.expert for x in held] == experts, "every expert held once, in order"
                    mgr.slots.wait_all(held)
                    check_call(h, world, held, hot_slots)
                    h.reading = True
                    mgr.slots.release_all(held)
                    h.reading = False
            h.fail_key = None
            # nothing is held between layer calls, and the table agrees with itself
            check_consistent(h, hot_keys)

        # the copy stream never wrote into a hot slot, and waited on the last read before every rewrite
        assert all(w[1] not in hot_slots for w in h.writes)
        checked = check_write_ordering(h) + check_ring_ordering(h)

        # hits/misses arithmetic
        s = report.stats(mgr)
        lookups = len(h.acquired)
        assert s.hits["gpu"] + s.hits["cpu"] + s.hits["nvme"] == lookups
        assert s.misses["gpu"] == s.hits["cpu"] + s.hits["nvme"]
        assert s.misses["cpu"] == s.hits["nvme"]
        assert s.misses["nvme"] == 0
        assert s.hits["gpu"] >= sum(1 for k in h.acquired if k in hot_keys), "a hot expert is always a gpu hit"
        nbytes = {k: manifest.ref(k, "bf16").nbytes for k in manifest.keys}
        assert s.bytes_moved == {"cpu": sum(nbytes[w[2]] for w in h.writes if w[3] == "cpu"),
                                 "nvme": sum(nbytes[w[2]] for w in h.writes if w[3] == "nvme")}
        assert all((w[3] == "cpu") == (w[2] in warm_keys) for w in h.writes), "every write comes from its expert's home tier"
        # every miss is one slot write, from the expert's home tier; every write is one miss unless a call
        # raised (its read-aheads that landed count their miss at their expert's next lookup, if it is still there)
        assert s.hits["cpu"] == sum(1 for w in h.writes if w[3] == "cpu")
        assert s.hits["nvme"] <= sum(1 for w in h.writes if w[3] == "nvme")
        if not raised:
            assert s.hits["cpu"] + s.hits["nvme"] == len(h.writes)
        return checked
    finally:
        mgr.close()


layer_calls = st.lists(
    st.tuples(
        st.integers(0, 2),  # layer
        st.sets(st.integers(0, 7), max_size=8).map(sorted),  # routed experts, ascending
        # sometimes a disk read of one expert of this call fails its checksum (IntegrityError)
        st.sampled_from([None, None, None, 0, 1, 2]),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(staging=st.integers(1, 5), n_hot=st.integers(1, 6), n_warm=st.integers(1, 6), calls=layer_calls)
def test_layer_calls_never_overwrite_a_slot_in_use(world, staging, n_hot, n_warm, calls):
    run_scenario(world, staging, n_hot, n_warm, calls)


@pytest.mark.parametrize("staging", [1, 2, 3, 4, 5])  # 1, 2, 4 divide the 8 experts of a layer; 3 and 5 do not
def test_rewrites_are_ordered_after_reads(world, staging):
    """Deterministic sweeps that force many slot rewrites, so the ordering check is exercised: each
    layer's experts in calls of ``staging`` (the last one shorter where it does not divide 8), whole
    layers that cannot be held at once, and calls whose disk read fails."""
    def sweep(L):
        return [(L, list(range(i, min(i + staging, 8))), None) for i in range(0, 8, staging)]

    calls = [c for L in (0, 1, 2, 1, 0) for c in sweep(L)]
    calls += [(2, list(range(8)), None), (2, [0, 3, 5, 7][:staging], None), (2, [1, 2, 4, 6][:staging], None), (0, [7], None)]
    calls += [(2, list(range(8))[:staging], 0), *sweep(2), (0, [6, 7][:staging], 1), *sweep(0)]
    checked = run_scenario(world, staging, n_hot=2, n_warm=5, calls=calls)
    assert checked > 0, "no slot was rewritten after a read: the ordering check did not run"


@pytest.mark.parametrize("staging", [1, 2, 3])
def test_failed_disk_read_leaves_slots_consistent(world, staging):
    """A checksum failure while staging a cold expert raises IntegrityError and changes nothing: no slot
    stays held, slot occupants and the table still agree, and serving (that expert too) goes on."""
    n = len(world.manifest.keys)
    h = build(world.manifest, staging, (staging + 1 + 0.5) / n, (1 + 0.5) / n)
    mgr = h.mgr
    try:
        hot_keys = set(mgr.placement.hot)
        cold = [k for k in mgr.placement.cold if k.layer == 2]
        first = [k.expert for k in cold[:staging]]  # fill every staging slot
        held = mgr.slots.acquire_layer(2, first)
        mgr.slots.wait_all(held)
        mgr.slots.release_all(held)
        victim = cold[staging]
        h.fail_key = victim
        with pytest.raises(IntegrityError, match="injected"):
            mgr.slots.acquire_layer(2, [victim.expert])
        assert h.failed_reads == 1 and mgr.table[victim].slot is None
        check_consistent(h, hot_keys)
        assert all(mgr.table.occupant(0, s) is not None for s in mgr.pools[0].staging), "the failed read emptied no slot"
        # the same expert and the slots' previous tenants are served exactly afterwards
        for experts in ([victim.expert], first, [victim.expert] + first[:1]):
            experts = sorted(experts)[:staging]
            held = mgr.slots.acquire_layer(2, experts)
            mgr.slots.wait_all(held)
            for x in held:
                assert_holds(x.tensors, world.truth[x.key], str(x.key))
            mgr.slots.release_all(held)
            check_consistent(h, hot_keys)
    finally:
        mgr.close()


# =============================================================================================
# Calls through a loaded model
# =============================================================================================
INT8 = {"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 2}, "cpu": {"fraction": 0.4}, "nvme": {"precision": "int8"}}}


def _nothing_held(mgr) -> bool:
    return all(r == 0 for p in mgr.pools for r in mgr.table.readers(p.index))


def test_a_call_that_does_not_fit_holds_nothing(packed_factory, device):
    """More misses than staging slots: ``acquire_layer`` gives up, releasing what it had held, and
    the same layer is then held in calls that fit."""
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    staging = len(mgr.pools[0].staging)
    misses = [e for e in range(8) if not mgr.table[ExpertKey(0, e)].hot]
    assert len(misses) > staging
    acquired = []
    real = mgr.slots.acquire
    mgr.slots.acquire = lambda key: (lambda got: acquired.append(got) or got)(real(key))
    assert mgr.slots.acquire_layer(0, list(range(8))) is None
    assert sum(x is not None for x in acquired) >= staging, "some experts were held before it gave up"
    assert _nothing_held(mgr)
    mgr.table.check()
    served = []
    for i in range(0, len(misses), staging):
        held = mgr.slots.acquire_layer(0, misses[i : i + staging])
        assert held is not None
        mgr.slots.wait_all(held)
        served += [x.key.expert for x in held]
        mgr.slots.release_all(held)
    assert served == misses and _nothing_held(mgr)


def test_an_exception_in_a_held_call_releases_its_slots(packed_factory, monkeypatch):
    """A kernel that raises inside the held path: its slots are released all the same."""
    from tiers.paths import compute
    from tiers.paths.routing import route

    model = tiers.load(packed_factory("mixtral"), INT8, device="cpu", progress=False)
    mgr = manager_of(model)
    from tiers.loader.layout import find_experts_modules

    module = find_experts_modules(model)[1][1]

    def boom(*a, **kw):
        assert not _nothing_held(mgr), "the call holds its experts while its kernels are queued"
        raise ZeroDivisionError

    monkeypatch.setattr(compute, "grouped_device", boom)
    monkeypatch.setattr(compute, "grouped_picks", boom)
    hot = [e for e in range(8) if mgr.table[ExpertKey(1, e)].hot]
    other = [e for e in range(8) if e not in hot][:2]  # as many misses as staging slots: the held path
    assert hot and len(other) == len(mgr.pools[0].staging)
    idx = torch.tensor([[hot[0], other[0]], [other[1], hot[0]]])
    with pytest.raises(ZeroDivisionError):
        mgr.held.run(module, 1, torch.randn(2, 64, dtype=torch.bfloat16), idx, torch.rand(2, 2, dtype=torch.bfloat16), route(idx, 8))
    assert _nothing_held(mgr)


def test_cached_staging_slot_is_a_gpu_hit(packed_factory, device):
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    cold = mgr.placement.cold[0]
    got = mgr.slots.acquire(cold)
    mgr.slots.wait_all([got])
    mgr.slots.release_all([got])
    before = report.stats(mgr)
    assert before.hits["nvme"] == 1
    again = mgr.slots.acquire(cold)
    assert again.slot == got.slot and all(t.dtype == torch.bfloat16 and t.device.type == device.type for t in again.tensors.values())
    mgr.slots.wait_all([again])
    mgr.slots.release_all([again])
    s = report.stats(mgr)
    assert s.hits["gpu"] == before.hits["gpu"] + 1 and s.hits["nvme"] == 1
    assert s.gpu_slots["cached"] >= 1


def test_more_misses_than_staging_slots_in_one_call(packed_factory, checkpoint_factory, device):
    """One staging slot, a call routed to every expert of a layer: served (streamed), every lookup
    counted once, nothing held after, and the output bit-identical to transformers' grouped_mm
    experts (bf16 tiers)."""
    from tiers.loader.layout import find_experts_modules
    from transformers import AutoModelForCausalLM

    cfg = {"tiers": {"gpu": {"fraction": 0.2, "staging_slots": 1}, "cpu": {"fraction": 0.4, "precision": "bf16"}, "nvme": {"precision": "bf16"}}}
    model = tiers.load(packed_factory("mixtral"), cfg, device=device, progress=False)
    mgr = manager_of(model)
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    g = torch.Generator().manual_seed(0)
    T, k = 8, 2
    idx = torch.stack([torch.arange(T) % 8, (torch.arange(T) + 3) % 8], dim=1).to(device)  # every expert, twice
    w = torch.rand(T, k, generator=g).to(device, torch.bfloat16)
    x = torch.randn(T, 64, generator=g).to(device, torch.bfloat16)
    with torch.no_grad():
        got = find_experts_modules(model)[2][1](x, idx, w)
        want = find_experts_modules(ref)[2][1](x, idx, w)
    assert torch.equal(got, want)
    s = tiers.stats(model)
    assert s.hits["cpu"] + s.hits["nvme"] + s.hits["gpu"] == 8
    assert s.streamed["calls"] == 1 and s.streamed["parts"] >= 7
    assert _nothing_held(mgr)
