"""Streamed calls (tiers.paths.streamed): a host-routed call whose non-hot experts outgrow the free
staging slots reads its misses part by part into reserved slots, two buffers taking turns, its
rows sorted once by (part, slot). It takes disk misses and calls whose picks are on the host too
(what the removed in-parts path served), its output bit-identical to transformers' grouped_mm, and
its reserved slots go back to the cache holding their last parts' experts.

Whole-layer calls, which plan through the same path without waiting for their routing, are in
tests/tiers/paths/test_whole.py; the order of a streamed call's reads, waits and kernels in
tests/tiers/paths/test_streamed_order.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tiers
from blob_files import decoded
from streamed_helpers import staged_layers, tiers_config
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey
from tiers.paths import streamed as streamed_mod
from tiers.paths.streamed import StreamedPath
from tiers.store.table import Home, SlotState
from untiered import assert_consistent, layer_calls, reference, spy_paths, spied_tiered_call

# a quarter of the GPU, every other expert warm; 4 staging slots: parts of 2 misses
WARM = {"gpu": {"fraction": 0.25, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}


def _load(packed, tiers_: dict, device):
    return tiers.load(packed, {"tiers": tiers_}, device=device, progress=False)


def _host_routed(monkeypatch, mgr) -> None:
    """No call runs whole: long calls wait for their routing, and those whose misses outgrow the slots stream."""
    monkeypatch.setattr(mgr.whole, "qualifies", lambda layer, tokens, top_k: False)


# -- exact outputs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_streamed_calls_are_bit_identical_to_grouped_mm(model_type, device, checkpoint_factory, packed_factory, monkeypatch):
    """bf16 tiers, every expert hot or warm: each layer call of 64 tokens waits for its routing and
    streams (more misses than half the slots); against transformers' grouped_mm on the same inputs,
    bit-identical."""
    ref = reference(checkpoint_factory(model_type), device)
    model = _load(packed_factory(model_type), WARM, device)
    mgr = manager_of(model)
    _host_routed(monkeypatch, mgr)
    calls = spy_paths(monkeypatch, mgr)
    mgr.reset_stats()
    for layer, name, mod, x, idx, w in layer_calls(model, 64):
        with torch.no_grad():
            want, got = ref.get_submodule(name)(x, idx, w), mod(x, idx, w)
        assert torch.equal(want, got), f"layer {layer}"
    s = tiers.stats(model)
    staged = len(staged_layers(mgr))
    assert staged and calls["streamed"] == s.streamed["calls"] == staged and s.streamed["whole"] == 0, (dict(calls), s.streamed)
    assert s.streamed["parts"] > 2 * s.streamed["calls"], "the calls must run in several parts"
    assert "long layer calls read in" in str(s) and s.as_dict()["streamed"] == s.streamed
    assert_consistent(mgr)


@pytest.mark.parametrize("tokens,staging", [(1, 1), (3, 2), (64, 2)])
def test_calls_whose_misses_outgrow_the_slots_stream_disk_misses_too(tokens, staging, device, checkpoint_factory, packed_factory, monkeypatch):
    """What the in-parts path served: a call whose non-hot experts outnumber the staging slots,
    some on disk (one slot: a single buffer), its picks on the host (1 or 3 tokens) or not (64).
    The streamed path serves it, reading its cold misses into the slots' ring buffers, and its
    output equals transformers' grouped_mm exactly, routing held fixed."""
    ref = reference(checkpoint_factory("mixtral"), device)
    model = _load(packed_factory("mixtral"), tiers_config(fraction=0.25, staging=staging, cpu={"fraction": 0.4}), device)
    mgr = manager_of(model)
    calls = spy_paths(monkeypatch, mgr)
    parts = []
    plan = mgr.streamed.plan
    monkeypatch.setattr(mgr.streamed, "plan", lambda *a, **kw: parts.append(len((s := plan(*a, **kw)).parts)) or s)
    nvme = 0
    for layer, name, mod, x, idx, w in layer_calls(model, tokens):
        used = idx.unique().tolist()
        cold = [e for e in used if mgr.table[ExpertKey(layer, e)].slot is None and mgr.table[ExpertKey(layer, e)].home is Home.NVME]
        need = sum(not mgr.table[ExpertKey(layer, e)].hot for e in used)
        misses = sum(mgr.table[ExpertKey(layer, e)].slot is None for e in used)
        picks_known = tokens * idx.shape[1] <= 64
        streams = need > staging or (not picks_known and staging >= 2 and misses > staging // 2)
        before = calls["streamed"]
        mgr.reset_stats()
        with torch.no_grad():
            want, got = ref.get_submodule(name)(x, idx, w), mod(x, idx, w)
        assert torch.equal(want, got), f"layer {layer}: differs from grouped_mm"
        assert calls["streamed"] == before + streams, f"layer {layer}: {need} non-hot experts, {misses} misses, {staging} slots"
        s = tiers.stats(model)
        assert s.hits["nvme"] == len(cold) and s.bytes_moved["nvme"] == len(cold) * mgr.manifest.layers[layer].blobs["bf16"].nbytes
        nvme += len(cold)
    assert calls["streamed"] > 0 and max(parts) > 1, f"no call streamed in parts ({dict(calls)}, {parts})"
    assert nvme > 0, "the calls must read disk misses"
    assert calls["whole"] == 0, "a layer with experts on disk in no slot waits for its routing"
    assert_consistent(mgr)


@pytest.mark.parametrize("direct_reads", [False, True])
def test_streamed_int8_is_grouped_mm_over_the_decoded_blobs(direct_reads, device, checkpoint_factory, packed_factory, monkeypatch):
    """INT8 tiers: a streamed call's output is transformers' grouped_mm over each expert's weights
    as its blob decodes alone (hot ones bf16), bit for bit; its stats count one cpu hit and one
    blob moved per miss and a gpu hit per expert already in a slot. Parts go through the copy
    engine even where small experts could be read in place (``direct_reads``, forced on the CPU:
    the reference kernel): a streamed part launches no direct stack."""
    packed = packed_factory("qwen3_moe")
    ref = reference(checkpoint_factory("qwen3_moe"), device)
    model = _load(packed, tiers_config("int8"), device)
    mgr = manager_of(model)
    mgr.staging.direct_reads = direct_reads
    _host_routed(monkeypatch, mgr)
    calls = spy_paths(monkeypatch, mgr)
    checked = 0
    for layer, name, mod, x, idx, w in layer_calls(model, 64, seed=5):
        if mgr.resident.qualifies(layer):
            continue
        ref_mod = ref.get_submodule(name)
        with torch.no_grad():
            for e in range(mod.num_experts):
                if not mgr.table[ExpertKey(layer, e)].hot:
                    for t, value in decoded(packed, ExpertKey(layer, e), "int8", device).items():
                        getattr(ref_mod, t)[e].copy_(value)
        used = idx.unique().tolist()
        misses = [e for e in used if mgr.table[ExpertKey(layer, e)].slot is None]
        mgr.reset_stats()
        before = calls["streamed"]
        with torch.no_grad():
            want, got = ref_mod(x, idx, w), mod(x, idx, w)
        assert calls["streamed"] == before + 1
        s = tiers.stats(model)
        blob = mgr.manifest.layers[layer].blobs["int8"].nbytes
        assert s.hits["cpu"] == len(misses) and s.bytes_moved["cpu"] == blob * len(misses)
        assert s.hits["gpu"] == len(used) - len(misses)
        assert s.direct["stacks"] == 0
        assert torch.equal(want, got), f"layer {layer}"
        checked += 1
    assert checked
    assert_consistent(mgr)


def test_a_streamed_call_with_a_trace_records_each_lookup_once(packed_factory, monkeypatch):
    """Recording a routing trace: a long call does not run whole; it streams, and every expert it
    routes to is recorded once (hot ones, ones cached in the slots it reserves, misses)."""
    model = _load(packed_factory("qwen3_moe"), tiers_config(fraction=0.25), "cpu")
    mgr = manager_of(model)
    calls = spy_paths(monkeypatch, mgr)
    mgr.slots.recorded = []
    for layer, name, mod, x, idx, w in layer_calls(model, 64, seed=2):
        if mgr.resident.qualifies(layer):
            continue
        mgr.slots.recorded.clear()
        with torch.no_grad():
            mod(x, idx, w)
        assert sorted(mgr.slots.recorded) == [ExpertKey(layer, e) for e in idx.unique().tolist()]
    assert calls["whole"] == 0 and calls["streamed"] == len(staged_layers(mgr))


def test_a_streamed_call_leaves_its_slots_cached_and_the_next_uses_them_in_place(device, checkpoint_factory, packed_factory, monkeypatch):
    """A streamed call's reserved slots go back to the cache holding its last parts' experts (the
    table saw every write), ready and unheld. The same call again reserves every staging slot,
    opens its first parts with those experts where they lie (no read: gpu hits), reads only the
    rest, shows the cache policy every lookup of a warm expert, and both outputs equal grouped_mm."""
    ref = reference(checkpoint_factory("qwen3_moe"), device)
    model = _load(packed_factory("qwen3_moe"), tiers_config(fraction=0.25), device)
    mgr = manager_of(model)
    _host_routed(monkeypatch, mgr)
    (layer, name, mod, x, idx, w), plans, want = spied_tiered_call(model, mgr, ref, monkeypatch, seed=7)
    pool = mgr.pool_of[layer]
    first = plans[-1]
    last = {slot: e for p in range(len(first.parts)) for e, slot in zip(first.parts[p], first.part_slots[p])}
    assert sorted(last) == list(pool.staging), "every staging slot ends holding the last part written into it"
    for slot, e in last.items():
        assert mgr.table.occupant(pool.index, slot) == ExpertKey(layer, e) and mgr.table[ExpertKey(layer, e)].slot == slot
        assert mgr.table.state(pool.index, slot) is SlotState.READY
    assert tiers.stats(model).gpu_slots["cached"] == len(pool.staging)
    used = {ExpertKey(layer, e) for e in idx.unique().tolist()}
    cached = {ExpertKey(layer, e) for e in last.values()} & used
    read = [k for k in used if not mgr.table[k].hot and k not in cached]
    accesses = []
    cache = mgr.caches[pool.index]
    access = cache.access
    monkeypatch.setattr(cache, "access", lambda key: accesses.append(key) or access(key))
    mgr.reset_stats()
    with torch.no_grad():
        assert torch.equal(mod(x, idx, w), want)
    s = plans[-1]
    assert len(s.buffers) == 2 and sorted(sum(s.buffers, [])) == list(pool.staging)
    assert s.preloaded == {k.expert for k in cached} and s.preloaded <= set(s.parts[0] + s.parts[1]) and all(mgr.table[h.key].hot for h in s.held)
    assert sorted(accesses) == sorted(k for k in used if not mgr.table[k].hot), "the policy sees every lookup of a warm expert"
    st = tiers.stats(model)
    assert st.streamed["calls"] == 1 and st.streamed["whole"] == 0
    assert st.bytes_moved["cpu"] == sum(mgr.manifest.ref(k, "bf16").nbytes for k in read), "a cached expert was read again"
    assert st.hits["gpu"] == len(used) - len(read) and st.misses["gpu"] == len(read)
    assert_consistent(mgr)


def test_a_streamed_call_empties_slots_cached_by_another_layer(device, checkpoint_factory, packed_factory, monkeypatch):
    """Staging slots holding another layer's experts (left by a short call) are emptied and
    reserved: those experts leave the GPU, and the output equals grouped_mm's."""
    ref = reference(checkpoint_factory("qwen3_moe"), device)
    model = _load(packed_factory("qwen3_moe"), tiers_config(fraction=0.25), device)
    mgr = manager_of(model)
    _host_routed(monkeypatch, mgr)
    calls = [c for c in layer_calls(model, 64, seed=5) if not mgr.resident.qualifies(c[0])]
    (first, _, mod1, x1, idx1, w1), (layer, name, mod, x, idx, w) = calls[:2]
    pool = mgr.pool_of[first]
    assert mgr.pool_of[layer] is pool
    with torch.no_grad():
        mod1(x1[:2], idx1[:2], w1[:2])  # a short call: held, its misses stay cached
    others = [mgr.table.occupant(pool.index, s) for s in pool.staging]
    others = [k for k in others if k is not None and k.layer == first]
    assert others, "the short call must leave experts of its layer cached"
    mgr.reset_stats()
    with torch.no_grad():
        got = mod(x, idx, w)
    assert tiers.stats(model).streamed["calls"] == 1
    assert all(mgr.table[k].slot is None for k in others)
    assert torch.equal(ref.get_submodule(name)(x, idx, w), got), f"layer {layer}"
    assert_consistent(mgr)


# -- the parts' copies ---------------------------------------------------------------------------------
def test_a_streamed_int8_part_is_one_stack_with_a_copy_per_run_of_adjacent_blobs(device, packed_factory):
    """INT8 through the copy engine: a part's misses go up in one copy per run of blobs lying back
    to back in the host pool, into consecutive transit rows, then one stacked dequantization;
    each slot then holds exactly its blob dequantized alone."""
    packed = packed_factory("qwen3_moe")
    mgr = manager_of(_load(packed, tiers_config("int8"), device))
    staging = mgr.staging
    copies, stacks = [], []
    check, dequantize = staging._check_pinned, staging._dequantize
    staging._check_pinned = lambda src: copies.append(src.numel()) or check(src)
    staging._dequantize = lambda b, g: stacks.append(list(g.slots)) or dequantize(b, g)
    width = staging.transit[mgr.pools[0].index].shape[1]
    runs_seen = 0
    for layer in staged_layers(mgr):
        s = mgr.streamed.plan(layer, list(range(8)))
        for p, part in enumerate(s.parts):
            copies.clear(), stacks.clear()
            mgr.streamed.read_part(s, p)
            offs = [mgr.table[ExpertKey(layer, e)].host_offset for e in part]
            runs = 1 + sum(b != a + width for a, b in zip(offs, offs[1:]))
            runs_seen += runs < len(part)
            assert len(copies) == runs and stacks == [s.part_slots[p]], (part, offs, copies, stacks)
            blob = mgr.manifest.layers[layer].blobs["int8"]
            assert sum(copies) == (len(part) - runs) * width + runs * blob.nbytes
            mgr.streamed.wait_part(s, p)
            for e, slot in zip(part, s.part_slots[p]):
                want = decoded(packed, ExpertKey(layer, e), "int8", device)
                assert all(torch.equal(s.pool.tensors(slot)[n], want[n]) for n in want), f"layer {layer} expert {e}"
            mgr.streamed.end_part(s, p)
        mgr.streamed.end(s)
    assert runs_seen, "no part had blobs back to back: the test must exercise a coalesced copy"
    assert_consistent(mgr)


def test_a_streamed_call_reads_its_misses_in_host_pool_order(device, packed_factory):
    """The rebalancer moves warm experts between host places (a demoted expert takes its
    newcomer's place): a streamed call takes its misses in the order of their places, so its
    parts copy as few runs as before such a swap, and each slot still holds its own expert."""
    packed = packed_factory("qwen3_moe")
    mgr = manager_of(_load(packed, tiers_config("int8"), device))
    copies = []
    check = mgr.staging._check_pinned
    mgr.staging._check_pinned = lambda src: copies.append(src.numel()) or check(src)
    layer = staged_layers(mgr)[0]

    def stream() -> list[list[int]]:
        copies.clear()
        for slot in mgr.pool_of[layer].staging:  # nothing cached: every warm expert is read
            if mgr.table.occupant(mgr.pool_of[layer].index, slot) is not None:
                mgr.slots.drop(mgr.pool_of[layer], slot)
        s = mgr.streamed.plan(layer, list(range(8)))
        for p in range(len(s.parts)):
            mgr.streamed.read_part(s, p)
            mgr.streamed.wait_part(s, p)
            for e, slot in zip(s.parts[p], s.part_slots[p]):
                want = decoded(packed, ExpertKey(layer, e), "int8", device)
                assert all(torch.equal(s.pool.tensors(slot)[n], want[n]) for n in want), f"expert {e}"
            mgr.streamed.end_part(s, p)
        mgr.streamed.end(s)
        return s.parts

    before = stream()
    n_copies = len(copies)
    warm = sorted(e for p in before for e in p)
    a, b = ExpertKey(layer, warm[0]), ExpertKey(layer, warm[-1])  # swap the first and last warm experts' places
    oa, ob = mgr.table[a].host_offset, mgr.table[b].host_offset
    n = mgr.manifest.ref(a, "int8").nbytes
    blob_a = mgr.host.view(oa, n).clone()
    mgr.host.view(oa, n).copy_(mgr.host.view(ob, n))
    mgr.host.view(ob, n).copy_(blob_a)
    mgr.table.move(a, ob)
    mgr.table.move(b, oa)
    after = stream()
    offs = [mgr.table[ExpertKey(layer, e)].host_offset for p in after for e in p]
    assert offs == sorted(offs), after
    assert len(copies) == n_copies, "the swap split the parts' runs"
    assert_consistent(mgr)


# -- the schedule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("held_after", [-1, 1])
@pytest.mark.parametrize("n_parts", [1, 2, 3, 7])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_run_parts_reads_each_part_as_soon_as_its_buffer_is_free(buffers, n_parts, held_after):
    """``StreamedPath.run_parts``' schedule, the first parts' reads queued by the caller (one per
    buffer; one buffer where a single staging slot is free): every part is read once; part q's
    reads come after the kernels of part q - n (the last user of its buffer, n buffers) and before
    the kernels of part q - n + 1, so the copy engine reads one part ahead of each buffer's reuse;
    each part's kernels wait for its reads; the held experts run after part ``held_after`` (-1:
    before every part)."""
    log = []
    path = StreamedPath.__new__(StreamedPath)
    path.mgr = SimpleNamespace(slots=SimpleNamespace(wait_all=lambda held: log.append(("held", None))))
    path.read_part = lambda s, p: log.append(("read", p))
    path.wait_part = lambda s, p: log.append(("wait", p))
    path.end_part = lambda s, p: log.append(("end", p))
    s = SimpleNamespace(buffers=tuple([] for _ in range(buffers)), parts=[[q] for q in range(n_parts)], held=[])
    for q in range(min(buffers, n_parts)):
        path.read_part(s, q)
    held_after = min(held_after, n_parts - 1)
    path.run_parts(s, lambda g: log.append(("run", g)), held_after)
    at = {e: i for i, e in enumerate(log)}
    assert sorted(p for w, p in log if w == "read") == list(range(n_parts)), "every part is read once"
    for q in range(n_parts):
        assert at[("read", q)] < at[("wait", q)] < at[("run", q + 1)] < at[("end", q)]
        if q >= buffers:
            assert at[("end", q - buffers)] < at[("read", q)] < at[("wait", q - buffers + 1)], f"part {q}"
    held = at[("held", None)]
    assert log[held + 1] == ("run", 0)
    if held_after < 0:
        assert held < at[("wait", 0)]
    else:
        assert at[("end", held_after)] < held < at.get(("wait", held_after + 1), len(log))


@pytest.mark.parametrize("misses,buffers", [(0, 2), (1, 2), (3, 2), (4, 2), (9, 2), (9, 3), (5, 1)])
def test_split_fills_each_buffer_cached_first_then_round_robin(misses, buffers):
    """``StreamedPath._split``: each buffer's cached experts open its first part, misses fill the
    rest of it, then go on in parts of a buffer each, buffer after buffer; buffers left empty give
    no part; every expert is in one part, in one slot of that part's buffer."""
    slots = list(range(10, 16))
    cut = [len(slots) * i // buffers for i in range(buffers + 1)]
    bufs = [slots[cut[i]:cut[i + 1]] for i in range(buffers)]
    cached = {bufs[0][0]: 100}  # one cached expert in the first buffer's first slot
    miss = list(range(misses))
    parts, part_slots = StreamedPath._split(bufs, cached, miss)
    assert sorted(e for p in parts for e in p) == sorted(miss + [100])
    assert parts[0][0] == 100 and part_slots[0][0] == bufs[0][0]
    for p, (part, ps) in enumerate(zip(parts, part_slots)):
        assert part and len(part) == len(ps) and set(ps) <= set(bufs[p % buffers]), (p, parts, part_slots)
    assert [e for p in parts for e in p if e != 100] == miss, "misses in the order given (host-pool order)"


def test_two_buffers_at_most(packed_factory):
    """A streamed call reserves every free staging slot, split into ``BUFFERS`` (two) buffers, or
    one when a single slot is free."""
    assert streamed_mod.BUFFERS == 2
    for staging, n in ((4, 2), (1, 1)):
        mgr = manager_of(_load(packed_factory("qwen3_moe"), tiers_config(fraction=0.4, staging=staging), "cpu"))
        layer = staged_layers(mgr)[0]
        s = mgr.streamed.plan(layer, list(range(8)))
        assert len(s.buffers) == n and sorted(sum(s.buffers, [])) == list(mgr.pool_of[layer].staging)
        assert all(mgr.table.reserved(s.pool.index, slot) == "stream" for b in s.buffers for slot in b)
        for p in range(len(s.parts)):
            mgr.streamed.read_part(s, p)
            mgr.streamed.wait_part(s, p)
            mgr.streamed.end_part(s, p)
        mgr.streamed.end(s)
        assert_consistent(mgr)
