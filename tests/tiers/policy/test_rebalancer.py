"""The rebalancer (tiers.policy.rebalancer): plans carried out on a loaded model.

Most tests drive a ``Manager`` on the CPU over a packed tiny Mixtral with every tier in bf16, so
any expert served from any tier, before or after a move, must equal its packed weights exactly.
Calls are driven as the host-routed paths make them: ``Manager.count_call`` (which opens a token
at the first pooled layer: ``Rebalancer.open_token``, then ``Rebalancer.count``), then
``Slots.acquire_layer``/``wait_all``/``release_all``. After every rebalance and every landing the
table's invariants are checked (``Table.check``).

``margin`` and ``significance`` are module constants now (no config key): tests that need moves
on small counts plan with both at 0 (the ``plans_move_on_any_gain`` fixture, what the old tests'
config gave), and one test checks the rebalancer plans with the constants themselves.
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiers
from tiers import report
from tiers.api import manager_of
from tiers.config import load_config
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.manager import Manager
from tiers.policy import rebalance, rebalancer
from tiers.policy.placement import plan_placement
from tiers.store.disk_store import DiskStore, IntegrityError
from tiers.store.table import Home

from tier_fakes import Recorder, RecordingStreams  # tests/tier_fakes.py

K = lambda L, e: ExpertKey(L, e)  # noqa: E731

BF16 = {"gpu": {"fraction": 0.25, "staging_slots": 2, "precision": "bf16"}, "cpu": {"fraction": 0.25, "precision": "bf16"},
        "nvme": {"precision": "bf16"}}


@pytest.fixture(autouse=True)
def plans_move_on_any_gain(monkeypatch):
    """The rebalancer plans with margin 0 and significance 0 (tiny models count few lookups; the
    plan's thresholds are tests/tiers/policy/test_rebalance.py's)."""
    monkeypatch.setattr(rebalancer, "plan_moves", functools.partial(rebalance.plan_moves, margin=0.0, significance=0.0))


def checked(mgr: Manager) -> Manager:
    """Check the table's invariants after every rebalance and every landing of ``mgr``'s rebalancer."""
    rb = mgr.rebalancer
    plan, land = rb.rebalance, rb.land

    def rebalance_checked(freq):
        moves = plan(freq)
        mgr.table.check()
        return moves

    def land_checked(wait=False):
        land(wait)
        mgr.table.check()

    rb.rebalance, rb.land = rebalance_checked, land_checked
    return mgr


def manager(packed, every=4, *, streams=None, **rebalance_cfg) -> Manager:
    cfg = load_config({"tiers": BF16 | {"rebalance": {"every_tokens": every} | rebalance_cfg}})
    manifest = read_manifest(packed)
    mgr = Manager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), streams=streams, progress=False)
    return checked(mgr)


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


def _check_held(mgr, held, truth) -> None:
    try:
        mgr.slots.wait_all(held)
        for h in held:
            for name, t in h.tensors.items():
                assert torch.equal(t, truth[h.key][name]), f"{h.key} {name} differs after a move"
    finally:
        mgr.slots.release_all(held)


def serve(mgr, layer, experts, truth) -> None:
    """Hold ``experts`` of ``layer`` as the held path does and check every one's weights bit-exactly;
    more misses than free staging slots: one at a time (what the streamed path's parts hold)."""
    held = mgr.slots.acquire_layer(layer, experts)
    if held is not None:
        _check_held(mgr, held, truth)
        return
    for e in experts:
        h = mgr.slots.acquire(K(layer, e))
        assert h is not None, f"{K(layer, e)}: every staging slot is held"
        _check_held(mgr, [h], truth)


def drive(mgr, calls, truth):
    """Serve ``calls`` (layer, experts) one token each, counted as a host-routed call counts them."""
    for layer, experts in calls:
        mgr.count_call(layer, experts, 1, prefill=True)
        serve(mgr, layer, experts, truth)


def hot_keys(mgr) -> set:
    return {k for k, r in mgr.table.items() if r.hot}


def warm_count(mgr) -> int:
    return sum(r.home is Home.CPU for _, r in mgr.table.items())


def skewed_calls(tokens, favourite):
    return [(L, sorted({favourite[L], (t * 3 + L) % 8})) for t in range(tokens) for L in range(3)]


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
    _check_held(mgr, held, truth)  # still its own weights, then released
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


# -- generate ------------------------------------------------------------------------------------
def test_generate_with_rebalancing_is_bit_identical(device, checkpoint_factory, packed_factory):
    """All tiers bf16: moving experts between tiers while generating changes no logit."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    cfg = {"tiers": BF16 | {"gpu": BF16["gpu"] | {"staging_slots": 8, "fraction": 0.6},
                            "rebalance": {"every_tokens": 2, "window": 2}}}
    model = tiers.load(packed_factory("mixtral"), cfg, device=device, progress=False)
    mgr = checked(manager_of(model))
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)
    s = tiers.stats(model)
    assert s.rebalance["rebalances"] >= 10 and s.rebalance["promoted_hot"] + s.rebalance["promoted_warm"] > 0
    mgr.table.check()
    mgr.close()


def test_direct_decode_tables_agree_after_swaps_land(device, packed_factory, monkeypatch):
    """Direct decode with the rebalancer swapping every two tokens: at every decode token's open,
    once its swaps have landed, the device tables equal the table (``DirectPath.agrees``) and the
    table's invariants hold; the logits equal those of the same tiers without the rebalancer
    (bf16 tiers; graphs off, so CUDA runs the CPU's calls op by op)."""
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8, "graphs": False}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                     "nvme": {"precision": "bf16"}}}  # every expert not hot is warm: every layer can run direct
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    out = []
    for every in (0, 2):
        model = tiers.load(packed_factory("mixtral"), {"tiers": cfg["tiers"] | {"rebalance": {"every_tokens": every, "window": 2}}},
                           device=device, progress=False)
        mgr = manager_of(model)
        if device.type == "cpu":  # what a GPU does; the torch reference stands in for the kernel
            mgr.batched_decode = True
            mgr.staging.direct_reads = True
            mgr.direct.enabled = True
        assert mgr.direct.enabled
        opened = []
        if every:
            checked(mgr)
            open_token = mgr._open_decode_token

            def open_checked(tokens, open_token=open_token, mgr=mgr):
                open_token(tokens)
                mgr.table.check()
                opened.append((mgr.table.homes_version, mgr.direct.version, mgr.direct.agrees()))
            monkeypatch.setattr(mgr, "_open_decode_token", open_checked)
        out.append(model.generate(ids, **kw))
        if every:
            s = tiers.stats(model)
            assert s.direct["decode_calls"] > 0, "no decode call ran direct"
            assert s.rebalance["promoted_hot"] > 0, "the test needs swaps during decode"
            assert opened and all(ok for *_, ok in opened), "the device tables disagree with the table"
            assert all(v == d for v, d, _ in opened), "a decode token ran on tables older than its swaps"
            assert len({v for v, *_ in opened}) > 1, "no swap landed between decode tokens"
            mgr.rebalancer.land(wait=True)
            mgr.direct.refresh()
            assert mgr.direct.agrees()
        mgr.close()
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert all(torch.equal(x, y) for x, y in zip(out[0].logits, out[1].logits))


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
                     "rebalance": {"every_tokens": 2, "window": 2}}}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False)
    mgr = checked(manager_of(model))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (1, 64), generator=g) for _ in range(6)]
    k = model.config.num_experts_per_tok
    assert all(mgr.whole.qualifies(L, 64, k) for L in mgr.manifest.layers if not mgr.resident.qualifies(L))
    hot0 = hot_keys(mgr)
    with torch.no_grad():
        for ids in prompts:
            assert torch.equal(ref(ids).logits, model(ids).logits)
    assert mgr.stats_.whole_calls >= len(prompts), "the prompts did not read their layers whole"
    mgr.rebalancer.land(wait=True)
    assert hot_keys(mgr) != hot0, "nothing moved between the prompts"
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    a, b = ref.generate(prompts[0], **kw), model.generate(prompts[0], **kw)
    assert torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    s = tiers.stats(model)
    assert s.rebalance["rebalances"] >= len(prompts) - 1 and s.rebalance["promoted_hot"] > 0
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
