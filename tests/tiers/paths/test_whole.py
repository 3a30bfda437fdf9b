"""Whole-layer calls (tiers.paths.whole): a prefill call long enough to route to every expert, at a
layer whose warm experts are all in the pinned pool, reads every one of them through the
streamed path's buffers without waiting for its routing; the rows are sorted and each part's row
range found on the device, and the call is counted later (``settle``), in call order.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tiers
from blob_files import decoded
from tier_fakes import recorded_manager
from tiers.api import manager_of
from tiers.graphs.graph_cache import GraphCache
from tiers.loader.layout import ExpertKey
from tiers.paths import whole as whole_mod
from tiers.paths.dispatch import Path, dispatch
from tiers.paths.streamed import KEY_END, Stream, Whole
from tiers.paths.whole import Plan
from untiered import assert_consistent, layer_calls, reference, spy_paths, spied_tiered_call, tiered_call


def _tiers(precision: str = "bf16", fraction: float = 0.4, **extra) -> dict:
    return {"gpu": {"fraction": fraction, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": precision},
            "nvme": {"precision": precision}, **extra}


def _load(packed, tiers_: dict, device):
    return tiers.load(packed, {"tiers": tiers_}, device=device, progress=False)


def _used(idx) -> list[int]:
    return sorted(set(idx.reshape(-1).tolist()))


def _whole_now(mgr, layer: int, idx) -> bool:
    return dispatch(mgr.facts(layer, *idx.shape)) is Path.WHOLE


def _reference_module(ref, name: str, mgr, layer: int, packed, precision: str, device):
    """The untiered experts module ``name``, its non-hot experts' weights as their ``precision``
    blobs decode (bf16: as they are)."""
    mod = ref.get_submodule(name)
    if precision != "bf16":
        with torch.no_grad():
            for e in range(mod.num_experts):
                if not mgr.table[ExpertKey(layer, e)].hot:
                    for t, value in decoded(packed, ExpertKey(layer, e), precision, device).items():
                        getattr(mod, t)[e].copy_(value)
    return mod


# -- exact, without a sync, counted once settled ----------------------------------------------------------
@pytest.mark.parametrize("model_type,precision", [("qwen3_moe", "bf16"), ("qwen3_moe", "int8"), ("mixtral", "bf16"),
                                                         ("gpt_oss", "bf16"), ("gpt_oss", "int8")])
def test_whole_layer_calls_run_without_a_sync_and_count_when_settled(model_type, precision, device, checkpoint_factory, packed_factory,
                                                                       monkeypatch):
    """Calls long enough to route to every expert read their layer's every warm expert with no
    host sync (on CUDA, sync debug mode raises on one) and count nothing until settled; then each
    used expert is one lookup, a cpu hit where it was read; the outputs equal transformers'
    grouped_mm over the experts' weights as the tiers hold them (bf16: exact; INT8: each blob
    decoded alone), bit for bit."""
    packed = packed_factory(model_type)
    model = _load(packed, _tiers(precision), device)
    mgr = manager_of(model)
    ref = reference(checkpoint_factory(model_type), device)
    calls = [c for c in layer_calls(model, 64, seed=11) if not mgr.resident.qualifies(c[0])]
    assert len(calls) == 3 and all(_whole_now(mgr, c[0], c[4]) for c in calls)
    used = [_used(c[4].cpu()) for c in calls]
    read = [[e for e in u if mgr.table[ExpertKey(c[0], e)].slot is None] for c, u in zip(calls, used)]
    with torch.no_grad():
        want = [_reference_module(ref, name, mgr, layer, packed, precision, device)(x, idx, w) for layer, name, _, x, idx, w in calls]
    paths = spy_paths(monkeypatch, mgr)
    mgr.reset_stats()
    monkeypatch.setattr(whole_mod, "UNSETTLED_CALLS", 2)  # a whole call counts the landed ones before it once two wait
    mgr.whole.last_layer = None  # ... and the last layer's call counts nothing after it (tested below)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            got = [mod(x, idx, w) for _, _, mod, x, idx, w in calls]
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert dict(paths) == {"whole": len(calls)}
    # a call that finds two waiting counts those whose rows have landed (on the CPU, all of them)
    settled = len(calls) - len(mgr.whole.unsettled)
    assert 0 <= settled < len(calls) and sum(mgr.stats_.hits.values()) == sum(map(len, used[:settled])), "counted before settling"
    if device.type == "cpu":
        assert settled == 2
    s = tiers.stats(model)
    assert not mgr.whole.unsettled
    assert s.streamed["whole"] == s.streamed["calls"] == len(calls) and s.streamed["unused"] == 0
    assert s.hits["cpu"] == sum(map(len, read)) and s.hits["gpu"] == sum(map(len, used)) - sum(map(len, read))
    blob = mgr.manifest.layers[calls[0][0]].blobs[precision].nbytes
    assert s.bytes_moved["cpu"] == blob * sum(map(len, read))
    assert "read their whole layer without a sync" in str(s)
    for (layer, *_), a, b in zip(calls, want, got):
        assert torch.equal(a, b), f"layer {layer}"
    assert_consistent(mgr)


@pytest.mark.parametrize("rebalance", [False, True])
def test_the_last_layers_whole_call_counts_the_landed_ones_without_a_sync(rebalance, device, packed_factory, monkeypatch):
    """After a forward's last pooled layer's whole-layer call is queued, the whole-layer calls
    whose rows have landed are counted there, with no host sync (CUDA's sync debug mode raises on
    one): on the CPU, where they land as they run, the whole pass; on CUDA, at least the pass
    before (landed: synchronized), never a call before the last layer's. The counts equal those
    of the same calls settled by ``stats``. With the rebalancer, the intervals those counts close
    rebalance there too, and, no direct call having run since, none reads direct decode's device
    counts (a sync)."""
    extra = {"rebalance": {"every_tokens": 8}} if rebalance else {}
    model = _load(packed_factory("qwen3_moe"), _tiers(**extra), device)
    mgr = manager_of(model)
    taken = []
    if rebalance:  # direct decode's tables built, as after a generate
        if device.type == "cpu":
            mgr.staging.direct_reads = mgr.direct.enabled = True  # the reference kernel stands in for the GPU's
        mgr.begin_decode()
        mgr.end_decode()
        assert mgr.direct.layers
        take = mgr.direct.take_usage
        monkeypatch.setattr(mgr.direct, "take_usage", lambda: taken.append(take()) or taken[-1])
    calls = [c for c in layer_calls(model, 64, seed=11) if not mgr.resident.qualifies(c[0])]
    assert len(calls) >= 2 and all(_whole_now(mgr, c[0], c[4]) for c in calls)
    assert mgr.whole.last_layer == calls[-1][0]
    monkeypatch.setattr(whole_mod, "UNSETTLED_CALLS", 1 << 30)  # only the last layer's rule counts
    used = [_used(c[4].cpu()) for c in calls]
    mgr.reset_stats()

    def run(debug: bool) -> None:
        if device.type == "cuda" and debug:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                for i, (_, _, mod, x, idx, w) in enumerate(calls):
                    mod(x, idx, w)
                    if i < len(calls) - 1:  # nothing is counted before the last layer's call
                        assert sum(mgr.stats_.hits.values()) == counted, f"counted after layer {calls[i][0]}"
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    counted = 0
    run(debug=False)
    if device.type == "cpu":
        assert not mgr.whole.unsettled and sum(mgr.stats_.hits.values()) == sum(map(len, used))
    counted = sum(mgr.stats_.hits.values())
    if device.type == "cuda":
        torch.cuda.synchronize()  # the first pass's rows have landed
    run(debug=True)
    first = sum(mgr.stats_.hits.values())
    assert first >= sum(map(len, used)), "the pass before was not counted at the last layer"
    assert len(mgr.whole.unsettled) <= len(calls)
    s = tiers.stats(model)
    assert not mgr.whole.unsettled and sum(s.hits.values()) == 2 * sum(map(len, used))
    assert s.streamed["whole"] == 2 * len(calls)
    if rebalance:
        assert s.rebalance["rebalances"] > 0 and taken and all(t is None for t in taken), taken
        mgr.rebalancer.land(wait=True)
    assert_consistent(mgr)


def test_a_whole_layer_call_uploads_its_plan_on_the_copy_stream_before_its_reads(device, checkpoint_factory, packed_factory, monkeypatch):
    """The plan's upload goes on the copy stream ahead of the first part's reads (on the compute
    stream it would wait for the copy engine to finish them), and the output is grouped_mm's."""
    model = _load(packed_factory("qwen3_moe"), _tiers(fraction=0.25), device)
    mgr = manager_of(model)
    ref = reference(checkpoint_factory("qwen3_moe"), device)
    layer, name, mod, x, idx, w = tiered_call(model, mgr, seed=2)
    assert _whole_now(mgr, layer, idx)
    log = []
    upload, part = mgr.uploads.int_lists, mgr.streamed.read_part
    monkeypatch.setattr(mgr.uploads, "int_lists", lambda lists, on=None: log.append(("upload", on)) or upload(lists, on=on))
    monkeypatch.setattr(mgr.streamed, "read_part", lambda s, p: log.append(("read", p)) or part(s, p))
    with torch.no_grad():
        got = mod(x, idx, w)
    assert tiers.stats(model).streamed["whole"] == 1
    assert log[0] == ("upload", mgr.staging.copy_stream) and ("read", 0) in log
    assert torch.equal(ref.get_submodule(name)(x, idx, w), got)


def test_a_whole_layer_call_counts_the_experts_it_read_in_vain(device, packed_factory, monkeypatch):
    """Routing that leaves some warm experts without a row: the call still reads them (it plans
    without the routing), counts them as read in vain with their bytes, and not as lookups; the
    cache policy's visit and lookups see only the used experts, as a call that waits would. That
    call used too few of its warm experts: the layer's next long call waits for its routing and
    reads only what it uses; one that uses them all makes the next one whole again."""
    model = _load(packed_factory("qwen3_moe"), _tiers(fraction=0.25), device)
    mgr = manager_of(model)
    layer, _, mod, x, idx, w = tiered_call(model, mgr, seed=2)
    assert layer != mgr.whole.last_layer, "the last layer's call would count itself at once"
    warm = [e for e in range(8) if mgr.table[ExpertKey(layer, e)].slot is None]
    unused = warm[:2]
    keep = [e for e in range(8) if e not in unused]
    g = torch.Generator().manual_seed(4)
    idx = torch.stack([torch.tensor(keep)[torch.randperm(len(keep), generator=g)[:2]] for _ in range(64)]).to(idx.device)
    assert _whole_now(mgr, layer, idx)
    cache = mgr.caches[mgr.pool_of[layer].index]
    visits, accesses = [], []
    visit, access = cache.visit, cache.access
    monkeypatch.setattr(cache, "visit", lambda L, keys=(): visits.append((L, [k.expert for k in keys])) or visit(L, keys))
    monkeypatch.setattr(cache, "access", lambda key: accesses.append(key.expert) or access(key))
    mgr.reset_stats()
    with torch.no_grad():
        mod(x, idx, w)
    assert not visits and not accesses, "counted before settling"
    s = tiers.stats(model)
    blob = mgr.manifest.layers[layer].blobs["bf16"].nbytes
    assert s.streamed["whole"] == 1 and s.streamed["unused"] == len(unused) and s.streamed["unused_bytes"] == blob * len(unused)
    assert s.bytes_moved["cpu"] == blob * len(warm), "every warm expert was read"
    assert s.hits["cpu"] == len(warm) - len(unused) and s.hits["gpu"] == len(keep) - (len(warm) - len(unused))
    assert visits == [(layer, _used(idx.cpu()))]
    assert sorted(accesses) == sorted(e for e in warm if e not in unused)
    assert "read their whole layer without a sync" in str(s) and "2 experts read in vain" in str(s)
    assert mgr.whole.used_share[layer] == (len(warm) - len(unused)) / len(warm) < whole_mod.USED
    assert not mgr.whole.qualifies(layer, *idx.shape) and not _whole_now(mgr, layer, idx)
    mgr.reset_stats()
    with torch.no_grad():
        mod(x, idx, w)
    s = tiers.stats(model)
    assert s.streamed["whole"] == 0 and s.bytes_moved["cpu"] <= blob * (len(warm) - len(unused))
    _, _, _, x2, idx2, w2 = next(c for c in layer_calls(model, 64, seed=2) if c[0] == layer)
    assert len(_used(idx2.cpu())) == 8
    with torch.no_grad():
        mod(x2, idx2, w2)
    assert mgr.whole.used_share[layer] == 1.0 and mgr.whole.qualifies(layer, *idx2.shape)


def test_a_whole_call_uses_the_experts_cached_in_its_slots_in_place(device, checkpoint_factory, packed_factory, monkeypatch):
    """A whole call leaves the staging slots holding its last parts' experts; the same call again
    (still more misses than half the slots) takes those where they lie (no read: gpu hits once
    settled), reads the rest, and both outputs equal grouped_mm's."""
    model = _load(packed_factory("qwen3_moe"), _tiers(fraction=0.25), device)
    mgr = manager_of(model)
    ref = reference(checkpoint_factory("qwen3_moe"), device)
    (layer, name, mod, x, idx, w), plans, want = spied_tiered_call(model, mgr, ref, monkeypatch, seed=7)
    pool = mgr.pool_of[layer]
    cached = {mgr.table.occupant(pool.index, s) for s in pool.staging} - {None}
    assert {k.layer for k in cached} == {layer} and len(cached) == len(pool.staging)
    used = {ExpertKey(layer, e) for e in _used(idx.cpu())}
    read = [k for k in used if not mgr.table[k].hot and k not in cached]
    assert _whole_now(mgr, layer, idx), "the test needs the second call whole too"
    mgr.reset_stats()
    with torch.no_grad():
        assert torch.equal(mod(x, idx, w), want)
    s = plans[-1]
    assert s.whole is not None and s.preloaded == {k.expert for k in cached} and s.whole.took == {k.expert for k in cached}
    st = tiers.stats(model)
    assert st.streamed["calls"] == st.streamed["whole"] == 1
    assert st.bytes_moved["cpu"] == sum(mgr.manifest.ref(k, "bf16").nbytes for k in read), "a cached expert was read again"
    assert st.hits["gpu"] == len(used) - len(read) and st.misses["gpu"] == len(read)
    assert_consistent(mgr)


# -- the plan and its buffers (recording streams) -------------------------------------------------------
def test_whole_layer_calls_settle_in_call_order_and_only_once_landed(packed_factory, monkeypatch):
    """Recording streams: ``settle(block=False)`` counts the calls whose rows have landed, in
    order, and stops at the first that has not; ``settle()`` counts every one. A whole call's first
    reads into each buffer wait on that buffer's slots' last reads, not on an event recorded after
    the kernels queued before the call; its buffers go in the order the previous call's last parts
    used them (the earliest first)."""
    mgr, rec, _ = recorded_manager(packed_factory("qwen3_moe"), _tiers())
    mgr.whole.last_layer = None  # no call counts the others at once
    layers = [L for L in sorted(mgr.manifest.layers) if not mgr.resident.qualifies(L)]
    order = []
    count = mgr.whole._count
    monkeypatch.setattr(mgr.whole, "_count", lambda s: order.append(s.layer) or count(s))
    streams, reordered = [], []
    for i, L in enumerate(layers * 2):
        # seven or eight experts: parts that end in different buffers, which the next call must read into last
        s = mgr.streamed.plan(L, list(range(7 if i % 2 == 0 else 8)), whole=Whole(64, 2))
        assert s.whole is not None and len(s.buffers) == 2
        if streams:  # the buffers are the previous call's, first the one its last kernels read first
            prev = streams[-1]
            assert sorted(s.buffers) == sorted(prev.buffers)
            last = [max(p for p in range(len(prev.parts)) if p % 2 == prev.buffers.index(b)) for b in s.buffers]
            assert last == sorted(last)
            # each buffer's first reads wait on the event after the previous call's last part in it
            assert all(s.freed[i] == [prev.freed[prev.buffers.index(b)][0]] for i, b in enumerate(s.buffers))
            assert not set(s.part_slots[0]) & set(prev.part_slots[-1])
            reordered.append(s.buffers != prev.buffers)
        for p in range(len(s.parts)):
            mgr.streamed.read_part(s, p)
            mgr.streamed.wait_part(s, p)
            mgr.streamed.end_part(s, p)
        mgr.streamed.end(s)
        mgr.whole._defer(s, torch.zeros(0, dtype=torch.int64), [])
        streams.append(s)
    assert not order and len(mgr.whole.unsettled) == len(streams)
    gates = [SimpleNamespace(landed=False) for _ in streams]
    for s, gate in zip(streams, gates):
        gate.query = lambda gate=gate: gate.landed
        gate.synchronize = lambda gate=gate: setattr(gate, "landed", True)
        s.whole.done = gate
    gates[0].landed = gates[2].landed = True
    mgr.whole.settle(block=False)
    assert order == layers[:1], "stops at the first call not landed"
    mgr.whole.settle()
    assert order == layers * 2 and not mgr.whole.unsettled and all(g.landed for g in gates)
    assert any(reordered), "some call must end its parts in a buffer other than the last"
    assert_consistent(mgr)


def test_a_buffer_no_part_used_keeps_its_slots_last_reads(packed_factory):
    """A whole call with fewer parts than buffers: the slots of a buffer no part read into go
    back unheld with the last reads they had (each its own), not an event of this call."""
    mgr, rec, streams = recorded_manager(packed_factory("qwen3_moe"), _tiers())
    layer = next(L for L in sorted(mgr.manifest.layers) if not mgr.resident.qualifies(L))
    pool = mgr.pool_of[layer]
    before = {}
    for slot in pool.staging:  # a distinct last read per slot
        ev = streams.event()
        ev.record(streams.current())
        mgr.table.reserve(pool.index, slot, "test")
        mgr.table.unreserve(pool.index, slot, "test", ev, keep=False)
        before[slot] = ev
    warm = [e for e in range(8) if not mgr.table[ExpertKey(layer, e)].hot]
    s = mgr.streamed.plan(layer, warm[:2], whole=Whole(64, 2))  # two misses: one part, in the first of two buffers
    assert [len(b) for b in s.buffers] == [2, 2] and len(s.parts) == 1
    assert s.freed == [[before[slot] for slot in b] for b in s.buffers], "each buffer's first reads wait on its slots' last reads"
    for p in range(len(s.parts)):
        mgr.streamed.read_part(s, p)
        mgr.streamed.wait_part(s, p)
        mgr.streamed.end_part(s, p)
    mgr.streamed.end(s)
    assert all(mgr.table.last_read(pool.index, slot) is before[slot] for slot in s.buffers[1])
    assert all(mgr.table.last_read(pool.index, slot) is s.freed[0][0] for slot in s.buffers[0])
    assert_consistent(mgr)


def test_a_whole_layer_call_runs_its_held_experts_after_parts_0_and_1(packed_factory, monkeypatch):
    """The held experts' kernels follow parts 0 and 1 (read first, during the layer before), so
    part 2's reads, which wait for part 0's kernels, run while they do."""
    model = _load(packed_factory("qwen3_moe"), _tiers(), "cpu")
    mgr = manager_of(model)
    layer, _, mod, x, idx, w = tiered_call(model, mgr, seed=5)
    order = []
    end_part, wait_all = mgr.streamed.end_part, mgr.slots.wait_all
    monkeypatch.setattr(mgr.streamed, "end_part", lambda s, p: order.append(p) or end_part(s, p))
    monkeypatch.setattr(mgr.slots, "wait_all", lambda held: order.append("held") or wait_all(held))
    with torch.no_grad():
        mod(x, idx, w)
    assert tiers.stats(model).streamed["whole"] == 1
    assert len(order) > 3 and order[:3] == [0, 1, "held"] and order[3:] == list(range(2, len(order) - 1))


# -- when a call runs whole --------------------------------------------------------------------------
def test_whole_layer_calls_need_long_calls_within_the_row_cap(packed_factory, monkeypatch):
    """A whole-layer call needs more rows than a host-routed call and at most ``ROWS``, a call
    long enough that uniform routing would use every expert but with chance 1e-3, and neither
    generate's decode stage nor a recorded routing trace."""
    mgr = manager_of(_load(packed_factory("qwen3_moe"), _tiers(), "cpu"))
    layer = next(L for L in mgr.manifest.layers if not mgr.resident.qualifies(L))
    w = mgr.whole
    assert w.qualifies(layer, 64, 2)
    assert not w.qualifies(layer, 32, 2), "64 rows: routed on the host"
    assert w.long_call(layer, 25, 2) and not w.long_call(layer, 24, 2)  # 0.75^25 <= 1e-3 < 0.75^24
    assert w.long_call(layer, 52, 1) and not w.long_call(layer, 51, 1)  # one pick per token: 0.875^52 <= 1e-3 < 0.875^51
    assert w.qualifies(layer, 40, 2) and not w.qualifies(layer, 64, 1), "64 rows: routed on the host"
    monkeypatch.setattr(whole_mod, "ROWS", 127)
    assert not w.qualifies(layer, 64, 2), "128 rows over the cap"
    monkeypatch.setattr(whole_mod, "ROWS", 128)
    assert w.qualifies(layer, 64, 2)
    assert dispatch(mgr.facts(layer, 64, 2)) is Path.WHOLE
    mgr.phase.decoding = True
    assert not mgr.facts(layer, 64, 2).whole and dispatch(mgr.facts(layer, 64, 2)) is Path.ROUTE
    mgr.phase.decoding = False
    mgr.slots.recorded = []
    assert dispatch(mgr.facts(layer, 64, 2)) is Path.ROUTE
    mgr.slots.recorded = None
    w.used_share[layer] = whole_mod.USED
    assert w.qualifies(layer, 64, 2)
    w.used_share[layer] = whole_mod.USED - 0.01
    assert not w.qualifies(layer, 64, 2)


# -- graphs and buffers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_whole_layer_calls_through_graphs_equal_the_eager_calls(precision, device, packed_factory, monkeypatch):
    """With prefill graphs on (by default with CUDA), a whole-layer call's plan and windows run
    eagerly, then are captured, then replay (on the CPU through ``HostGraph``): every call's
    output equals the same call's through the path that waits for its routing, inputs changing
    between calls of the same shapes (rows routed to the sentinel id among them, which no window
    writes), and the calls count as before."""
    model = _load(packed_factory("qwen3_moe"), _tiers(precision), device)
    mgr = manager_of(model)
    rounds = [[c for c in layer_calls(model, 64, seed=seed) if not mgr.resident.qualifies(c[0])] for seed in (11, 12, 11, 13, 14, 12)]
    for r, calls in enumerate(rounds[1:], 1):  # some picks to the sentinel id (expert parallelism), others each round
        for *_, mod, _, idx, _ in calls:
            idx[r::7, r % idx.shape[1]] = mod.num_experts
    assert rounds[0] and all(_whole_now(mgr, c[0], c[4]) for c in rounds[0])
    assert mgr.prefill_graphs.enabled == (device.type == "cuda")  # on by default with CUDA
    qualifies = mgr.whole.qualifies
    mgr.whole.qualifies = lambda *a: False  # the reference: the calls that wait for their routing
    with torch.no_grad():
        want = [[mod(x, idx, w) for _, _, mod, x, idx, w in calls] for calls in rounds]
    mgr.whole.qualifies = qualifies
    mgr.prefill_graphs = GraphCache(device, True)
    mgr.reset_stats()
    with torch.no_grad():
        got = [[mod(x, idx, w) for _, _, mod, x, idx, w in calls] for calls in rounds]
    for r, (a_round, b_round) in enumerate(zip(want, got)):
        for (layer, *_), a, b in zip(rounds[r], a_round, b_round):
            assert torch.equal(a, b), f"round {r}, layer {layer}"
    s = tiers.stats(model)
    counts = s.whole_graphs
    assert counts == mgr.prefill_graphs.counts() and "their plans and windows" in str(s)
    assert counts["failed"] == 0 and counts["captured"] > 0 and counts["replayed"] > counts["captured"], counts
    assert s.streamed["whole"] == s.streamed["calls"] == sum(map(len, rounds))
    assert_consistent(mgr)


def test_whole_layer_outputs_keep_the_last_two_shapes(packed_factory):
    mgr = manager_of(_load(packed_factory("qwen3_moe"), _tiers("int8"), "cpu"))
    cpu = torch.device("cpu")
    out = mgr.whole._out
    assert not mgr.prefill_graphs.enabled and out((4, 2), torch.float32, cpu) is not out((4, 2), torch.float32, cpu)
    mgr.prefill_graphs = GraphCache(cpu, True)
    a = out((4, 2), torch.float32, cpu)
    b = out((5, 2), torch.float32, cpu)
    assert out((4, 2), torch.float32, cpu) is a  # kept while its shape recurs
    out((6, 2), torch.float32, cpu)  # a third shape: the least recent (5, 2) goes
    assert out((4, 2), torch.float32, cpu) is a
    assert out((5, 2), torch.float32, cpu) is not b


def _stream(n_slots: int, held: dict[int, int], parts: list[dict[int, int]]) -> Stream:
    """A stream as ``Plan.of`` reads it: the pool's slot count, the held experts' slots, and each
    part's experts and slots (``{slot: expert}``)."""
    handles = [SimpleNamespace(slot=slot, key=ExpertKey(0, e)) for slot, e in held.items()]
    return Stream(0, SimpleNamespace(n_slots=n_slots), handles, [list(p.values()) for p in parts], [list(p) for p in parts], ([], []),
                  frozenset(), [[], []])


def test_a_whole_plans_windows_do_not_move_with_the_other_windows():
    """A window's first bound is its group's and first slot's alone: when the held experts' slots
    change (a rebalance), the parts' windows keep their bounds, so their graphs stay valid; and
    every expert's rows end at the bound after its own (group, slot)."""
    parts = [{12: 5, 13: 6, 14: 7}, {16: 8, 17: 9}]
    a = Plan.of(_stream(20, {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}, parts), 10)
    b = Plan.of(_stream(20, {2: 0, 19: 1, 3: 2, 4: 3, 5: 4}, parts), 10)  # other slots, split by WINDOW_GAP
    assert a.n_groups == b.n_groups == 3
    assert [seg for seg in a.segments if seg[0] > 0] == [seg for seg in b.segments if seg[0] > 0] == [(1, 12, 15, 33), (2, 16, 18, 58)]
    assert a.segments[0] == (0, 0, 5, 0) and b.segments[:2] == [(0, 2, 6, 2), (0, 19, 20, 19)]
    ends = dict(b.ends)
    assert ends == {0: 3, 1: 20, 2: 4, 3: 5, 4: 6, 5: 34, 6: 35, 7: 36, 8: 59, 9: 60}
    assert b.key_of[1] == 19 and b.key_of[8] == 2 * 20 + 16 and b.key_of[10] == KEY_END > 3 * 20  # the sentinel after every group
