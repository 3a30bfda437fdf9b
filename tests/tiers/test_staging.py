"""Staging batches: a layer call's lossy copies are queued one by one and dequantized stacked.

Checked here: the stacked dequantization is exact (each slot equals its blob dequantized alone),
both of its paths run (slots in a row: one launch per tensor over the stacked transit rows;
scattered: one launch per tensor for each run of slots in a row, a lone slot on its own), a batch waits once per stack and issues one ready event for it, a
transit row is rewritten only after the copy stream waited for the last dequantization that read
it, and a read that fails half-way through a batch leaves the writes queued before it valid.
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch

import tiers
import tiers.policy
from tiers.loader.layout import ExpertKey
from test_engine import _recorded_manager
from test_integrity import corrupt_expert, decoded
from tiers.integration import manager_of
from tiers.residency import Home

# every expert that is not hot lives as INT8, warm or cold; 6 staging slots
INT8 = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 6}, "cpu": {"fraction": 0.25, "precision": "int8"},
                  "nvme": {"precision": "int8"}}}


def expected(mgr, key: ExpertKey) -> dict[str, torch.Tensor]:
    """``key``'s weights as its home tier's blob in the file, dequantized alone on the manager's device."""
    return decoded(mgr.manifest.root, key, mgr._precision_of(mgr.table[key]), mgr.device)


def paths_taken(mgr) -> dict[str, int]:
    """Count the stacked dequantizations by path: slots in a row, or scattered."""
    taken = {"row": 0, "scatter": 0, "single": 0}
    inner = mgr._dequantize

    def spy(b, g):
        s0 = g.slots[0]
        kind = "single" if len(g.slots) == 1 else "row" if g.slots == list(range(s0, s0 + len(g.slots))) else "scatter"
        taken[kind] += 1
        return inner(b, g)

    mgr._dequantize = spy
    return taken


def staged_exactly(mgr, calls: int) -> int:
    """Random layer calls of 2 to 6 experts: every staged slot must equal its blob dequantized
    alone (``torch.equal``). Returns how many staged slots were checked."""
    rng = random.Random(0)
    layers = [L for L in mgr.manifest.layers if L not in mgr.static_maps]
    checked = 0
    for _ in range(calls):
        layer = rng.choice(layers)
        held = mgr.acquire_layer(layer, sorted(rng.sample(range(8), rng.randint(2, 6))))
        assert held is not None
        mgr.wait_all(held)
        for h in held:
            if mgr.table[h.key].pinned:
                continue
            want = expected(mgr, h.key)
            for name, t in h.tensors.items():
                assert torch.equal(t, want[name]), f"{h.key} {name}: the slot differs from its blob dequantized alone"
            checked += 1
        mgr.release_all(held)
    return checked


@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe"])
def test_stacked_dequantization_is_exact_on_both_paths(packed_factory, device, model):
    mgr = manager_of(tiers.load(packed_factory(model), INT8, device=device, progress=False))
    taken = paths_taken(mgr)
    assert staged_exactly(mgr, 40) > 40
    assert taken["row"] and taken["scatter"], f"both stacked paths must run: {taken}"
    assert all(r == 0 for p in mgr.pools for r in p.readers)


def _runs(slots: list[int]) -> list[int]:
    """The lengths of ``slots``' maximal runs of consecutive slots, in order."""
    out = []
    for i, s in enumerate(slots):
        if i and s == slots[i - 1] + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


def test_a_scattered_stack_dequantizes_each_run_of_slots_in_one_launch_per_tensor(packed_factory, monkeypatch):
    """A stack whose slots are not all in a row (a streamed part's slots skip the experts cached in
    its buffer) launches one dequantization per tensor for each run of slots in a row, not one
    per expert, and every slot still equals its blob dequantized alone."""
    from tiers import quant

    mgr = manager_of(tiers.load(packed_factory("qwen3_moe"), INT8, device="cpu", progress=False))
    scheme = quant.get_scheme("int8")
    launches = []
    real = scheme.dequantize
    monkeypatch.setattr(scheme, "dequantize", lambda q, out: (launches.append(1), real(q, out=out))[1])
    stacks = []
    inner = mgr._dequantize

    def spy(b, g):
        before = len(launches)
        inner(b, g)
        stacks.append((list(g.slots), len(g.blob.shapes), len(launches) - before))

    mgr._dequantize = spy
    assert staged_exactly(mgr, 60) > 60
    mixed = [(slots, tensors, n) for slots, tensors, n in stacks if 1 < len(_runs(slots)) < len(slots)]
    assert mixed, f"no stack with a run of slots among scattered ones: {[s for s, _, _ in stacks]}"
    for slots, tensors, n in stacks:
        assert n == tensors * len(_runs(slots)), f"stack over slots {slots}: {n} launches for runs {_runs(slots)}"


def _lossy_misses(mgr, layer: int) -> list[int]:
    return [e for e in range(8) if mgr.table[ExpertKey(layer, e)].home is not Home.GPU]


@pytest.mark.parametrize("limit", [2, 6])
def test_a_batch_dequantizes_once_per_stack_after_all_its_copies(packed_factory, limit):
    mgr, rec, streams = _recorded_manager(packed_factory("mixtral"), staging=6)
    pool = mgr.pools[0]
    mgr.stack_limit[id(pool)] = limit
    layer = next(L for L in mgr.manifest.layers if len(_lossy_misses(mgr, L)) >= 4)
    misses = _lossy_misses(mgr, layer)[:5]
    start = len(rec.order)
    held = mgr.acquire_layer(layer, misses)
    order = rec.order[start:]
    copies = [i for i, o in enumerate(order) if o[0] == "use" and o[1] is mgr.copy_stream]
    dq_waits = [i for i, o in enumerate(order) if o[0] == "wait" and o[1] is mgr.dequant_stream]
    readies = [o[2] for o in order if o[0] == "record" and o[1] is mgr.dequant_stream]
    stacks = -(-len(misses) // limit)
    assert len(copies) == len(misses), "one copy per miss, each queued as its miss is claimed"
    assert len(dq_waits) == len(readies) == stacks
    for n, w in enumerate(dq_waits):  # stack n dequantizes after the copies of its experts were queued
        assert copies[min(len(misses), (n + 1) * limit) - 1] < w
    assert [h.pool.ready[h.slot] for h in held] == [r for r in readies for _ in range(limit)][: len(misses)]
    mgr.wait_all(held)
    mgr.release_all(held)


def test_an_expert_too_large_to_stack_goes_up_one_tensor_at_a_time(packed_factory):
    """Stacks of 1 (experts too large to stack): per miss, one copy per tensor, and each tensor's
    dequantization waits on an event recorded right after its own copy, queued before the next
    tensor's copy, so it overlaps that copy; one ready event per expert, the slot's."""
    mgr, rec, streams = _recorded_manager(packed_factory("mixtral"), staging=6)
    pool = mgr.pools[0]
    mgr.stack_limit[id(pool)] = 1
    layer = next(L for L in mgr.manifest.layers if len(_lossy_misses(mgr, L)) >= 3)
    misses = _lossy_misses(mgr, layer)[:3]
    tensors = len(mgr.manifest.blob(ExpertKey(layer, misses[0]), "int8").shapes)
    assert tensors == 2  # gate_up_proj and down_proj
    start = len(rec.order)
    held = mgr.acquire_layer(layer, misses)
    order = rec.order[start:]
    landed = {id(o[2]): i for i, o in enumerate(order) if o[0] == "record" and o[1] is mgr.copy_stream}
    dq_waits = [(i, o[2]) for i, o in enumerate(order) if o[0] == "wait" and o[1] is mgr.dequant_stream]
    readies = [o[2] for o in order if o[0] == "record" and o[1] is mgr.dequant_stream]
    copies = [i for i, o in enumerate(order) if o[0] == "use" and o[1] is mgr.copy_stream]
    assert len(readies) == len(misses) and len(dq_waits) == tensors * len(misses)
    for i, ev in dq_waits:
        at = landed[id(ev)]  # recorded on the copy stream right after a copy, before the wait
        assert at < i
        before = [c for c in copies if c < at]
        assert before, "a landed event before any copy"
        later = [c for c in copies if c > at]
        if later:  # the next copy is queued after this dequantization: it overlaps it
            assert i < later[0]
    assert [h.pool.ready[h.slot] for h in held] == readies
    mgr.wait_all(held)
    mgr.release_all(held)


@pytest.mark.parametrize("ring", [False, True])
def test_large_experts_staged_by_tensor_are_exact(packed_factory, device, ring, monkeypatch):
    """Every expert counted as too large to stack: each slot equals its blob dequantized alone,
    with a transit row per staging slot, or (``ring``: the placement counts them as too large
    too, as it does Mixtral-8x7B's) through a ring of two rows that 20 calls of up to 6 misses
    wrap many times, so a copy that overwrote a row before its dequantization read it would
    show."""
    from tiers.engine import TierManager

    monkeypatch.setattr(TierManager, "STACK_BYTES", 1024)
    if ring:
        monkeypatch.setattr(tiers.policy, "STACK_BYTES", 1024)
    mgr = manager_of(tiers.load(packed_factory("mixtral"), INT8, device=device, progress=False))
    assert all(mgr.stack_limit[id(p)] == 1 for p in mgr.pools)
    assert [len(mgr.transit[id(p)]) for p in mgr.pools] == [2 if ring else 6] * len(mgr.pools)
    spans = []
    inner = mgr._stage_by_tensor
    mgr._stage_by_tensor = lambda *a: spans.append(a[3]) or inner(*a)
    assert staged_exactly(mgr, 20) > 20
    assert spans, "the by-tensor path must run"


@pytest.mark.parametrize("limit, large", [(2, False), (1, False), (1, True)])
def test_a_transit_row_is_rewritten_only_after_its_last_dequantization(packed_factory, limit, large, monkeypatch):
    """Random layer calls and prefetches over a ring of 3 transit rows with stacks of up to 2 (or of
    1: experts staged tensor by tensor; ``large``: experts the placement counts as too large to
    stack, over a ring of 2 rows for the 3 staging slots): each copy into a row comes after a
    copy-stream wait on the ready event of the row's last reader."""
    if large:
        monkeypatch.setattr(tiers.policy, "STACK_BYTES", 1024)
    mgr, rec, streams = _recorded_manager(packed_factory("mixtral"), staging=3)
    pid = id(mgr.pools[0])
    assert mgr.transit[pid].shape[0] == (2 if large else 3)
    mgr.stack_limit[pid] = limit
    writes: list[tuple[int, int, int]] = []  # (transit row, order index before the staging, after its copies were queued)
    readers: dict[int, list] = {}  # row -> ready events of the dequantizations that read it, in order
    stage, dequantized = mgr._stage, mgr._dequantized

    def spy_stage(key, pool, slot, precision, source, src, **kw):
        row, begin = mgr.next_row[pid], len(rec.order)
        out = stage(key, pool, slot, precision, source, src, **kw)
        if not mgr.manifest.blob(key, precision).precision == "bf16":
            writes.append((row, begin, len(rec.order)))
        return out

    def spy_dequantized(b, pool, slots, row, ready):
        dequantized(b, pool, slots, row, ready)
        for r in range(row, row + len(slots)):
            readers.setdefault(r, []).append((ready, len(rec.order)))

    mgr._stage, mgr._dequantized = spy_stage, spy_dequantized
    rng = random.Random(1)
    layers = [L for L in mgr.manifest.layers if L not in mgr.static_maps]
    for _ in range(60):
        layer = rng.choice(layers)
        experts = sorted(rng.sample(range(8), rng.randint(1, 3)))
        need = sum(not mgr.table[ExpertKey(layer, e)].pinned for e in experts)
        if need > 3:
            continue
        held = mgr.acquire_layer(layer, experts)
        mgr.wait_all(held)
        mgr.release_all(held)
        if rng.random() < 0.5:
            mgr.prefetch(rng.choice(layers), rng.sample(range(8), 3))
    order = rec.order
    where = {id(o[2]): i for i, o in enumerate(order) if o[0] == "record"}
    rewrites = 0
    for row, begin, at in writes:
        earlier = [ev for ev, t in readers.get(row, []) if t <= begin]
        if not earlier:
            continue
        ev = earlier[-1]
        rewrites += 1
        assert any(o[0] == "wait" and o[1] is mgr.copy_stream and o[2] is ev for o in order[where[id(ev)] + 1 : at]), (
            f"transit row {row} rewritten without the copy stream waiting on its last dequantization"
        )
    assert rewrites > 20


def test_a_failed_read_inside_a_batch_leaves_the_queued_writes_valid(packed_factory, tmp_path):
    root = tmp_path / "packed"
    shutil.copytree(packed_factory("qwen3_moe"), root)
    cfg = {"tiers": {**INT8["tiers"], "rebalance": {"every_tokens": 0}}}
    mgr = manager_of(tiers.load(root, cfg, device="cpu", progress=False))
    layer, warm, cold = next(
        (L, w, c) for L in mgr.manifest.layers
        for w in [[e for e in range(8) if mgr.table[ExpertKey(L, e)].home is Home.CPU]]
        for c in [[e for e in range(8) if mgr.table[ExpertKey(L, e)].home is Home.NVME]]
        if len(w) >= 2 and c
    )
    bad = ExpertKey(layer, cold[0])
    corrupt_expert(root, bad, "int8")
    with pytest.raises(tiers.IntegrityError):
        mgr.acquire_layer(layer, sorted(warm[:2] + [bad.expert]))
    assert all(r == 0 for p in mgr.pools for r in p.readers), "nothing stays held"
    staged = [ExpertKey(layer, e) for e in warm[:2] if mgr.table[ExpertKey(layer, e)].slot is not None]
    assert staged, "the warm misses before the bad read were staged"
    held = mgr.acquire_layer(layer, [k.expert for k in staged])
    assert mgr.stats().hits["gpu"] >= len(staged)
    mgr.wait_all(held)
    for h in held:
        want = expected(mgr, h.key)
        assert all(torch.equal(t, want[n]) for n, t in h.tensors.items())
    mgr.release_all(held)
