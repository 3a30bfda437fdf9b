"""Staging (tiers.transfer.staging): a layer call's copies into its slots, batched, dequantized in stacks.

Checked here: the stacked dequantization is exact (each slot equals its blob dequantized alone)
for stacks of slots in a row and of scattered ones, each one ``quant.direct`` launch, a
batch waits once per stack and issues one ready event for it, a transit row is rewritten only
after the copy stream waited for the last dequantization that read it, dequantization runs on
its own stream after the copy, and a read that fails half-way through a batch leaves the writes
queued before it valid. And the reader's side (``tiers.slots.Slots``): ``wait_all`` waits once
per stream on the latest write, ``release_all`` records one last-read event for the staged
slots and none for hot ones.
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from blob_files import corrupt_expert, decoded
from tier_fakes import index_of_record, recorded_manager
import tiers
import tiers.transfer.staging as staging_mod
from tiers import report
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey
from tiers.policy import placement
from tiers.store.table import Home


# every expert that is not hot lives as INT8, warm or cold; 6 staging slots
INT8 = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 6}, "cpu": {"fraction": 0.25, "precision": "int8"},
                  "nvme": {"precision": "int8"}}}


def _recorded(packed, staging: int = 4, cpu: str = "int8"):
    """A CPU manager on recording streams: gpu 0.4 with ``staging`` slots, cpu 0.5 in ``cpu``, nvme int8."""
    return recorded_manager(packed, {"gpu": {"fraction": 0.4, "staging_slots": staging}, "cpu": {"fraction": 0.5, "precision": cpu}})



def _dequantized(order: list, staging) -> list:
    """The records on the dequant stream, less the index uploads' reader marks (``Uploads.read_by``):
    one ready event per dequantization."""
    marks = {id(e) for e in staging.uploads._events}
    return [o for o in order if o[0] == "record" and o[1] is staging.dequant_stream and id(o[2]) not in marks]

def expected(mgr, key: ExpertKey) -> dict[str, torch.Tensor]:
    """``key``'s weights as its home tier's blob in the file, dequantized alone on the manager's device."""
    return decoded(mgr.manifest.root, key, mgr.staging.precision_of(mgr.table[key]), mgr.device)


def pooled_layers(mgr) -> list[int]:
    """Layers that stage their misses (not every expert hot)."""
    return [L for L in mgr.manifest.layers if not mgr.resident.qualifies(L)]


def nothing_held(mgr) -> bool:
    return all(r == 0 for p in mgr.pools for r in mgr.table.readers(p.index))


def paths_taken(mgr) -> dict[str, int]:
    """Count the stacked dequantizations by path: slots in a row, or scattered."""
    taken = {"row": 0, "scatter": 0, "single": 0}
    inner = mgr.staging._dequantize

    def spy(b, g):
        s0 = g.slots[0]
        kind = "single" if len(g.slots) == 1 else "row" if g.slots == list(range(s0, s0 + len(g.slots))) else "scatter"
        taken[kind] += 1
        return inner(b, g)

    mgr.staging._dequantize = spy
    return taken


def staged_exactly(mgr, calls: int) -> int:
    """Random layer calls of 2 to 6 experts: every staged slot must equal its blob dequantized
    alone (``torch.equal``). Returns how many staged slots were checked."""
    rng = random.Random(0)
    layers = pooled_layers(mgr)
    checked = 0
    for _ in range(calls):
        layer = rng.choice(layers)
        held = mgr.slots.acquire_layer(layer, sorted(rng.sample(range(8), rng.randint(2, 6))))
        assert held is not None
        mgr.slots.wait_all(held)
        for h in held:
            if mgr.table[h.key].hot:
                continue
            want = expected(mgr, h.key)
            for name, t in h.tensors.items():
                assert torch.equal(t, want[name]), f"{h.key} {name}: the slot differs from its blob dequantized alone"
            checked += 1
        mgr.slots.release_all(held)
    return checked


@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe"])
def test_stacked_dequantization_is_exact_on_both_paths(packed_factory, device, model):
    mgr = manager_of(tiers.load(packed_factory(model), INT8, device=device, progress=False))
    taken = paths_taken(mgr)
    assert staged_exactly(mgr, 40) > 40
    assert taken["row"] and taken["scatter"], f"both stacked paths must run: {taken}"
    assert nothing_held(mgr)
    mgr.table.check()


def _runs(slots: list[int]) -> list[int]:
    """The lengths of ``slots``' maximal runs of consecutive slots, in order."""
    out = []
    for i, s in enumerate(slots):
        if i and s == slots[i - 1] + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


def test_a_stack_decodes_in_one_launch_wherever_its_slots_lie(packed_factory, monkeypatch):
    """A stack, its slots in a row or not (a call's misses land in the cache's victims, wherever
    they lie), is decoded from its transit rows by one ``quant.direct`` launch, and every slot
    still equals its blob dequantized alone."""
    from tiers.quant import direct

    mgr = manager_of(tiers.load(packed_factory("qwen3_moe"), INT8, device="cpu", progress=False))
    launches, stacks = [], []
    real, inner = direct.fetch, mgr.staging._dequantize
    monkeypatch.setattr(direct, "fetch", lambda *a, **k: (launches.append(1), real(*a, **k))[1])

    def spy(b, g):
        before = len(launches)
        inner(b, g)
        stacks.append((list(g.slots), len(launches) - before))

    mgr.staging._dequantize = spy
    assert staged_exactly(mgr, 60) > 60
    assert any(1 < len(_runs(slots)) for slots, _ in stacks), f"no scattered stack: {[s for s, _ in stacks]}"
    assert any(len(slots) > 1 and len(_runs(slots)) == 1 for slots, _ in stacks), "no stack of slots in a row"
    assert all(n == 1 for _, n in stacks), f"launches per stack: {stacks}"


def _lossy_misses(mgr, layer: int) -> list[int]:
    return [e for e in range(8) if mgr.table[ExpertKey(layer, e)].home is not Home.GPU]


@pytest.mark.parametrize("limit", [2, 6])
def test_a_batch_dequantizes_once_per_stack_after_all_its_copies(packed_factory, limit):
    mgr, rec, streams = _recorded(packed_factory("mixtral"), staging=6)
    staging, pool = mgr.staging, mgr.pools[0]
    staging.stack_limit[pool.index] = limit
    layer = next(L for L in mgr.manifest.layers if len(_lossy_misses(mgr, L)) >= 5)
    misses = _lossy_misses(mgr, layer)[:5]
    start = len(rec.order)
    held = mgr.slots.acquire_layer(layer, misses)
    order = rec.order[start:]
    copies = [i for i, o in enumerate(order) if o[0] == "use" and o[1] is staging.copy_stream]
    dq_waits = [i for i, o in enumerate(order) if o[0] == "wait" and o[1] is staging.dequant_stream]
    readies = [o[2] for o in _dequantized(order, staging)]
    stacks = -(-len(misses) // limit)
    assert len(copies) == len(misses), "one copy per miss, each queued as its miss is claimed"
    assert len(dq_waits) == len(readies) == stacks
    for n, w in enumerate(dq_waits):  # stack n dequantizes after the copies of its experts were queued
        assert copies[min(len(misses), (n + 1) * limit) - 1] < w
    assert [mgr.table.ready_event(h.pool.index, h.slot) for h in held] == [r for r in readies for _ in range(limit)][: len(misses)]
    mgr.slots.wait_all(held)
    mgr.slots.release_all(held)


def test_an_expert_too_large_to_stack_goes_up_one_tensor_at_a_time(packed_factory):
    """Stacks of 1 (experts too large to stack): per miss, one copy per tensor, and each tensor's
    dequantization waits on an event recorded right after its own copy, queued before the next
    tensor's copy, so it overlaps that copy; one ready event per expert, the slot's."""
    mgr, rec, streams = _recorded(packed_factory("mixtral"), staging=6)
    staging, pool = mgr.staging, mgr.pools[0]
    staging.stack_limit[pool.index] = 1
    layer = next(L for L in mgr.manifest.layers if len(_lossy_misses(mgr, L)) >= 3)
    misses = _lossy_misses(mgr, layer)[:3]
    tensors = len(mgr.manifest.blob(ExpertKey(layer, misses[0]), "int8").shapes)
    assert tensors == 2  # gate_up_proj and down_proj
    start = len(rec.order)
    held = mgr.slots.acquire_layer(layer, misses)
    order = rec.order[start:]
    landed = {id(o[2]): i for i, o in enumerate(order) if o[0] == "record" and o[1] is staging.copy_stream}
    dq_waits = [(i, o[2]) for i, o in enumerate(order) if o[0] == "wait" and o[1] is staging.dequant_stream]
    readies = [o[2] for o in _dequantized(order, staging)]
    copies = [i for i, o in enumerate(order) if o[0] == "use" and o[1] is staging.copy_stream]
    assert len(readies) == len(misses) and len(dq_waits) == tensors * len(misses)
    for i, ev in dq_waits:
        at = landed[id(ev)]  # recorded on the copy stream right after a copy, before the wait
        assert at < i
        before = [c for c in copies if c < at]
        assert before, "a landed event before any copy"
        later = [c for c in copies if c > at]
        if later:  # the next copy is queued after this dequantization: it overlaps it
            assert i < later[0]
    assert [mgr.table.ready_event(h.pool.index, h.slot) for h in held] == readies
    mgr.slots.wait_all(held)
    mgr.slots.release_all(held)


@pytest.mark.parametrize("ring", [False, True])
def test_large_experts_staged_by_tensor_are_exact(packed_factory, device, ring, monkeypatch):
    """Every expert counted as too large to stack: each slot equals its blob dequantized alone,
    with a transit row per staging slot, or (``ring``: the placement counts them as too large
    too, as it does Mixtral-8x7B's) through a ring of two rows that 20 calls of up to 6 misses
    wrap many times, so a copy that overwrote a row before its dequantization read it would
    show."""
    monkeypatch.setattr(staging_mod, "STACK_BYTES", 1024)
    if ring:
        monkeypatch.setattr(placement, "STACK_BYTES", 1024)
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    assert all(mgr.staging.stack_limit[p.index] == 1 for p in mgr.pools)
    assert [len(mgr.staging.transit[p.index]) for p in mgr.pools] == [2 if ring else 6] * len(mgr.pools)
    spans = []
    inner = mgr.staging._stage_by_tensor
    mgr.staging._stage_by_tensor = lambda *a: spans.append(a[3]) or inner(*a)
    assert staged_exactly(mgr, 20) > 20
    assert spans, "the by-tensor path must run"


@pytest.mark.parametrize("limit, large", [(2, False), (1, False), (1, True)])
def test_a_transit_row_is_rewritten_only_after_its_last_dequantization(packed_factory, limit, large, monkeypatch):
    """Random layer calls (with their cold misses read ahead) over a ring of 3 transit rows with
    stacks of up to 2 (or of 1: experts staged tensor by tensor; ``large``: experts the placement
    counts as too large to stack, over a ring of 2 rows for the 3 staging slots): each copy into a
    row comes after a copy-stream wait on the ready event of the row's last reader."""
    if large:
        monkeypatch.setattr(placement, "STACK_BYTES", 1024)
    mgr, rec, streams = _recorded(packed_factory("mixtral"), staging=3)
    staging = mgr.staging
    pid = mgr.pools[0].index
    assert staging.transit[pid].shape[0] == (2 if large else 3)
    staging.stack_limit[pid] = limit
    writes: list[tuple[int, int, int]] = []  # (transit row, order index before the write, after its copies were queued)
    readers: dict[int, list] = {}  # row -> ready events of the dequantizations that read it, in order
    write, dequantized = staging.write, staging._dequantized

    def spy_write(key, pool, slot, precision, source, src, direct_ok=True):
        if staging._batch is None:  # a batch of one around this very call
            return write(key, pool, slot, precision, source, src, direct_ok)
        row, begin = staging.next_row[pid], len(rec.order)
        out = write(key, pool, slot, precision, source, src, direct_ok)
        if precision != "bf16":
            writes.append((row, begin, len(rec.order)))
        return out

    def spy_dequantized(b, pool, slots, row, ready):
        dequantized(b, pool, slots, row, ready)
        for r in range(row, row + len(slots)):
            readers.setdefault(r, []).append((ready, len(rec.order)))

    staging.write, staging._dequantized = spy_write, spy_dequantized
    rng = random.Random(1)
    layers = pooled_layers(mgr)
    for _ in range(80):
        layer = rng.choice(layers)
        experts = sorted(rng.sample(range(8), rng.randint(1, 3)))
        need = sum(not mgr.table[ExpertKey(layer, e)].hot for e in experts)
        if need > 3:
            continue
        held = mgr.slots.acquire_layer(layer, experts)
        mgr.slots.wait_all(held)
        mgr.slots.release_all(held)
    order = rec.order
    rewrites = 0
    for row, begin, at in writes:
        earlier = [ev for ev, t in readers.get(row, []) if t <= begin]
        if not earlier:
            continue
        ev = earlier[-1]
        rewrites += 1
        assert any(o[0] == "wait" and o[1] is staging.copy_stream and o[2] is ev for o in order[index_of_record(order, ev) + 1 : at]), (
            f"transit row {row} rewritten without the copy stream waiting on its last dequantization"
        )
    assert rewrites > 20


def test_a_failed_read_inside_a_batch_leaves_the_queued_writes_valid(packed_factory, tmp_path):
    root = tmp_path / "packed"
    shutil.copytree(packed_factory("qwen3_moe"), root)
    mgr = manager_of(tiers.load(root, INT8, device="cpu", progress=False))
    layer, warm, cold = next(
        (L, w, c) for L in mgr.manifest.layers
        for w in [[e for e in range(8) if mgr.table[ExpertKey(L, e)].home is Home.CPU]] if len(w) >= 2
        for c in [[e for e in range(8) if mgr.table[ExpertKey(L, e)].home is Home.NVME and e > w[1]]] if c
    )
    bad = ExpertKey(layer, cold[0])  # looked up after the two warm misses
    corrupt_expert(root, bad, "int8")
    with pytest.raises(tiers.IntegrityError):
        mgr.slots.acquire_layer(layer, sorted(warm[:2] + [bad.expert]))
    assert nothing_held(mgr), "nothing stays held"
    mgr.table.check()
    assert mgr.table[bad].slot is None
    staged = [ExpertKey(layer, e) for e in warm[:2] if mgr.table[ExpertKey(layer, e)].slot is not None]
    assert staged == [ExpertKey(layer, e) for e in warm[:2]], "the warm misses before the bad read were staged"
    before = report.stats(mgr).hits["gpu"]
    held = mgr.slots.acquire_layer(layer, [k.expert for k in staged])
    assert report.stats(mgr).hits["gpu"] == before + len(staged)
    mgr.slots.wait_all(held)
    for h in held:
        want = expected(mgr, h.key)
        assert all(torch.equal(t, want[n]) for n, t in h.tensors.items())
    mgr.slots.release_all(held)


# -- the copy pipeline, observed through recording streams ----------------------------------------
def test_dequantization_runs_on_its_own_stream_after_the_copy(packed_factory):
    mgr, rec, streams = _recorded(packed_factory("mixtral"))
    staging = mgr.staging
    assert len(streams.made) == 2 and staging.dequant_stream is not staging.copy_stream
    for L in (0, 1, 2, 0, 1, 2):
        misses = [e for e in range(8) if not mgr.table[ExpertKey(L, e)].hot]
        for i in range(0, len(misses), 4):  # calls that fit the 4 staging slots
            held = mgr.slots.acquire_layer(L, misses[i : i + 4])
            mgr.slots.wait_all(held)
            mgr.slots.release_all(held)
    order = rec.order
    recorded_on = {id(o[2]): o[1] for o in order if o[0] == "record"}
    dq_waits = [o for o in order if o[0] == "wait" and o[1] is staging.dequant_stream]
    readies = _dequantized(order, staging)
    assert readies and len(dq_waits) == len(readies), "one wait per dequantization"
    assert all(recorded_on[id(o[2])] is staging.copy_stream for o in dq_waits), "the dequant stream waits on the copy only"
    for i, o in enumerate(order):  # each such wait comes after its event was recorded
        if o in dq_waits:
            assert any(p[0] == "record" and p[2] is o[2] for p in order[:i])
    # a transit row is rewritten only after its last dequantization: the copy stream waits on those
    reused = [o for o in order if o[0] == "wait" and o[1] is staging.copy_stream and recorded_on.get(id(o[2])) is staging.dequant_stream]
    n_staging = sum(p.n_slots - p.hot for p in mgr.pools)
    assert len(reused) >= len(readies) - n_staging


@pytest.mark.parametrize("cpu", ["int8", "bf16"])
def test_wait_all_waits_once_per_stream_on_the_latest_copy(packed_factory, cpu):
    """A layer call's held experts: the compute stream waits once per stream that wrote them, on
    the latest of their ready events (a stream runs in order, so it covers the others), and every
    one of their ready events was recorded on that stream no later than the one waited on. With
    bf16 warm and INT8 cold experts the writes end on two streams (copy and dequant)."""
    mgr, rec, streams = _recorded(packed_factory("mixtral"), staging=6, cpu=cpu)
    table = mgr.table
    layer = 1
    held = mgr.slots.acquire_layer(layer, list(range(6)))
    assert held is not None
    where = {id(o[2]): i for i, o in enumerate(rec.order) if o[0] == "record"}
    pending = {}
    for h in held:
        ev = table.ready_event(h.pool.index, h.slot)
        if ev is not None:
            pending[h.slot] = (ev, rec.order[where[id(ev)]][1])
    assert len(pending) >= 2, "the call must stage several experts"
    streams_used = {id(st) for _, st in pending.values()}
    if cpu == "bf16":
        assert len(streams_used) == 2, "bf16 warm copies end on the copy stream, INT8 cold ones on the dequant stream"
    start = len(rec.order)
    mgr.slots.wait_all(held)
    waits = [o for o in rec.order[start:] if o[0] == "wait"]
    assert len(waits) == len(streams_used) and all(w[1] is streams.compute for w in waits)
    for w in waits:
        on = next(st for ev, st in pending.values() if ev is w[2])
        covered = [ev for ev, st in pending.values() if st is on]
        assert all(where[id(ev)] <= where[id(w[2])] for ev in covered), "an expert's copy is not covered by the wait"
    assert all(table.ready_event(h.pool.index, h.slot) is None for h in held)
    mgr.slots.release_all(held)


def test_release_all_records_one_last_read_for_the_staged_and_none_for_hot(packed_factory):
    mgr, rec, streams = _recorded(packed_factory("mixtral"), staging=3)
    table = mgr.table
    layer = next(L for L in pooled_layers(mgr) if any(table[ExpertKey(L, e)].hot for e in range(8)))
    hot = [e for e in range(8) if table[ExpertKey(layer, e)].hot]
    staged = [e for e in range(8) if e not in hot][:3]
    assert hot and staged
    held = mgr.slots.acquire_layer(layer, sorted(hot + staged))
    mgr.slots.wait_all(held)
    before = {h.slot: table.last_read(h.pool.index, h.slot) for h in held}
    start = len(rec.order)
    mgr.slots.release_all(held)
    records = [o for o in rec.order[start:] if o[0] == "record"]
    assert len(records) == 1 and records[0][1] is streams.compute
    for h in held:
        if h.key.expert in hot:
            assert table.last_read(h.pool.index, h.slot) is before[h.slot] is None
        else:
            assert table.last_read(h.pool.index, h.slot) is records[0][2]
    assert nothing_held(mgr)
