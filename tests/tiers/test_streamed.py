"""Streamed calls: a long layer call whose warm misses outnumber half the free staging slots is
read part by part into reserved slots (tiers.streamed), its rows sorted once by (part, slot)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiers
from tiers.loader.layout import ExpertKey
from tiers.integration import find_experts_modules, manager_of

# a quarter of the experts hot, the rest warm; 4 staging slots: parts of 2 misses
WARM = {"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}}


def _cfg(precision: str, fraction: float = 0.4) -> dict:
    return {"tiers": {"gpu": {"fraction": fraction, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": precision},
                      "nvme": {"precision": precision}}}


def _calls(model, tokens: int, seed: int = 3):
    """Per experts module: random inputs of ``tokens`` tokens, each routed to k distinct experts."""
    g = torch.Generator().manual_seed(seed)
    k = model.config.num_experts_per_tok
    dev = next(model.parameters()).device
    for layer, (name, mod) in find_experts_modules(model).items():
        x = torch.randn(tokens, mod.hidden_dim, generator=g).to(dev, torch.bfloat16)  # [T, H]
        idx = torch.stack([torch.randperm(mod.num_experts, generator=g)[:k] for _ in range(tokens)]).to(dev)  # [T, k]
        w = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(dev, torch.bfloat16)  # [T, k]
        yield layer, name, mod, x, idx, w


def _assert_close(want, got, device, what):
    if device.type == "cpu":
        assert torch.equal(want, got), f"{what}: differs"
    else:  # the kernels may tile a part's rows differently: one bf16 ulp
        err = (want.float() - got.float()).abs()
        assert (err <= 2**-7 * want.float().abs() + 1e-6).all(), f"{what}: max error {err.max().item():.3g}"


def _assert_consistent(mgr):
    """Nothing held; every slot's owner is resident there, and every resident expert owns its slot."""
    assert all(r == 0 for p in mgr.pools for r in p.readers)
    for pool in mgr.pools:
        for s, key in enumerate(pool.owner):
            if key is not None:
                assert mgr.table[key].slot == s, f"slot {s} owned by {key}, which the table puts in {mgr.table[key].slot}"
    for key in mgr.manifest.keys:
        r = mgr.table[key]
        if r.slot is not None:
            assert mgr.pool_of[key.layer].owner[r.slot] == key, f"{key} resident in slot {r.slot} it does not own"


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_streamed_calls_match_grouped_mm(model_type, device, checkpoint_factory, packed_factory):
    """bf16 tiers: each layer call of 64 tokens streams (every expert hot or warm, more misses than
    half the slots); against transformers' grouped_mm on the same inputs, bit-identical on the CPU."""
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory(model_type), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    model = tiers.load(packed_factory(model_type), WARM, device=device, progress=False)
    mgr = manager_of(model)
    mgr.reset_stats()
    staged_layers = 0
    for layer, name, mod, x, idx, w in _calls(model, 64):
        staged_layers += layer not in mgr.static_maps
        with torch.no_grad():
            want, got = ref.get_submodule(name)(x, idx, w), mod(x, idx, w)
        _assert_close(want, got, device, f"layer {layer}")
    s = mgr.stats()
    assert staged_layers and s.streamed["calls"] == staged_layers, s.streamed
    assert s.streamed["parts"] > 2 * s.streamed["calls"], "the calls must run in several parts"
    assert "long layer calls read in" in str(s) and s.as_dict()["streamed"] == s.streamed
    _assert_consistent(mgr)


@pytest.mark.parametrize("direct", [False, True])
def test_streamed_int8_equals_the_general_path(direct, device, packed_factory):
    """INT8 tiers, through copies and dequantizations or (``direct``) direct stacks: the streamed
    call's output equals the general path's (parts staged through the cache) on the same inputs,
    and its stats count one cpu hit and one blob moved per miss."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg("int8"), device=device, progress=False)
    mgr = manager_of(model)
    if device.type == "cpu":
        mgr.direct_reads = True  # the torch reference stands in for the kernel
    mgr.stream_direct = direct
    checked = 0
    for layer, name, mod, x, idx, w in _calls(model, 64, seed=5):
        if layer in mgr.static_maps:
            continue
        misses = [e for e in idx.unique().tolist() if mgr.table[ExpertKey(layer, e)].slot is None]
        mgr.streamed_calls = False
        with torch.no_grad():
            want = mod(x, idx, w)
        for e in misses:  # leave the misses as they were: not cached by the general path's call
            r = mgr.table[ExpertKey(layer, e)]
            if r.slot is not None:
                mgr.drop_staged(mgr.pool_of[layer], r.slot)
        mgr.streamed_calls = True
        mgr.reset_stats()
        with torch.no_grad():
            got = mod(x, idx, w)
        s = mgr.stats()
        assert s.streamed["calls"] == 1
        blob = mgr.manifest.layers[layer].blobs["int8"].nbytes
        assert s.hits["cpu"] == len(misses) and s.bytes_moved["cpu"] == blob * len(misses)
        assert s.hits["gpu"] == idx.unique().numel() - len(misses)
        assert (s.direct["stacks"] > 0) == direct
        _assert_close(want, got, device, f"layer {layer}")
        checked += 1
    assert checked
    _assert_consistent(mgr)


@pytest.mark.parametrize("first_two", [False, True])
@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_streamed_parts_read_after_the_part_before_last_and_before_their_kernels(ahead, first_two, packed_factory):
    """Recording streams: part p's reads come after the copy stream waited on the event recorded
    after part p - 2's kernels (the same half) and before the compute stream's wait for them,
    which precedes part p's kernels; parts alternate between two disjoint buffers. With ``ahead``
    of the call's experts read ahead into staging slots first, those are not read again: they
    open parts 0 and 1, and the compute stream waits on their read-ahead before those kernels.
    ``first_two``: parts 0 and 1 are queued before any kernel, as ``_grouped_streamed`` does."""
    from test_engine import _recorded_manager

    mgr, rec, _ = _recorded_manager(packed_factory("qwen3_moe"), staging=4, cpu="bf16", cpu_share={"budget": "64MiB"})
    layer = next(L for L in mgr.manifest.layers if L not in mgr.static_maps)
    warm = [e for e in range(8) if not mgr.table[ExpertKey(layer, e)].pinned]
    assert mgr.prefetch(layer, warm[-ahead:] if ahead else [], None) == ahead
    pool = mgr.pool_of[layer]
    pre_ready = {mgr.table[ExpertKey(layer, e)].slot: pool.ready[mgr.table[ExpertKey(layer, e)].slot] for e in warm[-ahead:]} if ahead else {}
    reads, batched = mgr._queue_read, mgr._stage_copy_batch
    mgr._queue_read = lambda b, key, pool, slot, *a, **kw: rec.order.append(("read", slot, key)) or reads(b, key, pool, slot, *a, **kw)
    key_at = {mgr.table[ExpertKey(layer, e)].host_offset: ExpertKey(layer, e) for e in warm}  # warm place -> expert

    def record_batched(b, pool, blob, slots, srcs):  # bf16 parts: one batch of copies, each slot read once
        rec.order.extend(("read", slot, key_at[src.data_ptr() - mgr.host.slab.data_ptr()]) for slot, src in zip(slots, srcs))
        return batched(b, pool, blob, slots, srcs)
    mgr._stage_copy_batch = record_batched
    s = mgr.begin_stream(layer, list(range(8)))
    assert s is not None and len(s.parts) >= 3, "the test needs three parts or more"
    assert len(s.buffers) == 2 and not set(s.buffers[0]) & set(s.buffers[1])
    assert s.preloaded == set(warm[-ahead:] if ahead else []) and s.preloaded <= set(s.parts[0] + s.parts[1])
    assert sorted(e for part in s.parts for e in part) == warm and not s.held or all(mgr.table[h.key].pinned for h in s.held)
    kernels = {}
    mgr.stream_part(s, 0)
    if first_two:
        mgr.stream_part(s, 1)
    mgr.wait_all(s.held)
    for p in range(len(s.parts)):
        if p + 1 < len(s.parts) and not (first_two and p == 0):
            mgr.stream_part(s, p + 1)
        mgr.wait_part(s, p)
        kernels[p] = len(rec.order)
        rec.order.append(("kernels", p, None))
        mgr.end_part(s, p)
    mgr.end_stream(s)
    order = rec.order
    compute = mgr.streams.current()
    for p, part in enumerate(s.parts):
        for e, slot in zip(part, s.slots(p)):
            if e in s.preloaded:  # no read; its read-ahead (or a later event on that stream) is waited on before the part's kernels
                at = next(i for i, o in enumerate(order) if o[0] == "record" and o[2] is pre_ready[slot])
                later = {id(o[2]) for o in order[at:] if o[0] == "record" and o[1] is order[at][1]}
                assert any(o[0] == "wait" and o[1] is compute and id(o[2]) in later for o in order[at:kernels[p]]), f"part {p}, slot {slot}"
        part = [e for e in part if e not in s.preloaded]
        if not part:
            continue
        at = [i for i, o in enumerate(order) if o[0] == "read" and o[2] in {ExpertKey(layer, e) for e in part}]
        assert len(at) == len(part) and {order[i][1] for i in at} == {sl for e, sl in zip(s.parts[p], s.slots(p)) if e in part}
        if p >= 2:
            freed = next(o[2] for o in order[kernels[p - 2]:] if o[0] == "record" and o[1] is compute)
            assert any(o[0] == "wait" and o[1] is mgr.copy_stream and o[2] is freed for o in order[kernels[p - 2]:at[0]]), f"part {p}"
        # the compute stream waits on an event recorded after the part's reads, before its kernels
        waits = [o[2] for o in order[at[-1]:kernels[p]] if o[0] == "wait" and o[1] is compute]
        recorded_after = {id(o[2]) for o in order[at[-1]:kernels[p]] if o[0] == "record"}
        assert any(id(ev) in recorded_after for ev in waits), f"part {p}: kernels do not wait for its reads"
    # each buffer goes back with the event recorded right after its last part's kernels
    for h, half in enumerate(s.buffers):
        last = max(p for p in range(len(s.parts)) if p % 2 == h)
        after = next(o[2] for o in order[kernels[last]:] if o[0] == "record" and o[1] is compute)
        assert all(pool.last_read[slot] is after for slot in half), f"buffer {h}"
    assert all(r == 0 for p_ in mgr.pools for r in p_.readers)


def test_a_streamed_call_that_fails_gives_its_slots_back_after_its_reads(packed_factory):
    """A call that stops after queuing part 0's reads, before its kernels: every reserved slot
    goes back with one last-read event recorded after the compute stream waited on those reads."""
    from test_engine import _recorded_manager

    mgr, rec, _ = _recorded_manager(packed_factory("qwen3_moe"), staging=4, cpu="bf16", cpu_share={"budget": "64MiB"})
    layer = next(L for L in mgr.manifest.layers if L not in mgr.static_maps)
    s = mgr.begin_stream(layer, list(range(8)))
    pool, compute = mgr.pool_of[layer], mgr.streams.current()
    mgr.stream_part(s, 0)
    read_events = {id(pool.ready[slot]) for slot in s.slots(0)}
    start = len(rec.order)
    mgr.end_stream(s)
    tail = rec.order[start:]
    waited = next(i for i, o in enumerate(tail) if o[0] == "wait" and o[1] is compute and id(o[2]) in read_events)
    ev = next(o[2] for o in tail[waited:] if o[0] == "record" and o[1] is compute)
    assert all(pool.last_read[slot] is ev for b in s.buffers for slot in b)
    assert all(r == 0 for r in pool.readers)


@pytest.mark.parametrize("case", ["cold", "recorded", "fits", "off"])
def test_streaming_falls_back(case, packed_factory):
    """A cold miss, a recorded trace, misses that fit half the free slots, or streaming switched
    off: begin_stream declines and holds nothing."""
    cfg = _cfg("bf16")
    if case == "cold":
        cfg["tiers"]["cpu"] = {"fraction": 0.3, "precision": "bf16"}
    mgr = manager_of(tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False))
    layer = next(L for L in mgr.manifest.layers if L not in mgr.static_maps)
    experts = list(range(8))
    if case == "recorded":
        mgr.recorded = []
    elif case == "fits":
        experts = [e for e in experts if mgr.table[ExpertKey(layer, e)].pinned] + \
                  [e for e in experts if not mgr.table[ExpertKey(layer, e)].pinned][:2]
        experts.sort()
    elif case == "off":
        mgr.streamed_calls = False
    else:
        assert any(mgr.table[ExpertKey(layer, e)].home.value == "nvme" for e in experts)
    assert mgr.begin_stream(layer, experts) is None
    assert all(r == 0 for p in mgr.pools for r in p.readers)


def test_a_streamed_call_prefetches_into_half_the_slots_it_gave_back(checkpoint_factory, packed_factory):
    """With lookahead on, a streamed call stages the next layer's predicted experts into at most
    half the staging slots once it gave them back, so the next long call still streams through
    the other half; those reads go through the copy engine even where direct stacks could serve
    them (forced on here: the torch reference), while a short call's lookahead may use direct
    stacks; the forward's logits equal the untiered model's."""
    cfg = WARM | {"tiers": WARM["tiers"] | {"gpu": WARM["tiers"]["gpu"] | {"prefetch_depth": 1}}}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False)
    mgr = manager_of(model)
    mgr.direct_reads = True
    mgr.whole_calls = False  # calls that wait for their routing: whole-layer calls predict nothing
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen3_moe"), dtype=torch.bfloat16).eval()
    ref.set_experts_implementation("grouped_mm")
    staging = mgr.stats().gpu_slots["staging"]
    issued, direct_stacks = [], []
    prefetch, stage_direct = mgr.prefetch, mgr._stage_direct
    mgr.prefetch = lambda layer, experts, limit=None, direct=True: issued.append((limit, prefetch(layer, experts, limit, direct), direct)) or issued[-1][1]
    mgr._stage_direct = lambda *a: direct_stacks.append(a) or stage_direct(*a)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    mgr.reset_stats()
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.equal(got, want)
    s = mgr.stats()
    layers = len(mgr.manifest.layers) - len(mgr.static_maps)
    assert s.streamed["calls"] == layers, s.streamed
    after = [n for limit, n, _ in issued if limit is not None]
    assert len(after) == layers - 1 and all(n <= staging // 2 for n in after) and any(after), issued
    assert s.prefetch["used"] > 0, "the next call finds prefetched experts resident"
    assert not direct_stacks, "a streamed call and its read-aheads read through the copy engine"
    before = len(issued)
    with torch.no_grad():  # short calls: their lookahead may read through direct stacks
        model(ids[:, :1])
    assert issued[before:] and all(direct for _, _, direct in issued[before:])
    _assert_consistent(mgr)


def test_a_streamed_int8_part_is_one_stack_with_a_copy_per_run_of_adjacent_blobs(device, packed_factory):
    """INT8 through the copy engine: a part's misses go up in one copy per run of blobs lying back
    to back in the host pool, into consecutive transit rows, then one stacked dequantization;
    each slot then holds exactly its blob dequantized alone."""
    from test_integrity import decoded

    packed = packed_factory("qwen3_moe")
    mgr = manager_of(tiers.load(packed, _cfg("int8"), device=device, progress=False))
    mgr.stream_direct = False
    copies, stacks = [], []
    check, dequantize = mgr._check_pinned, mgr._dequantize
    mgr._check_pinned = lambda src: copies.append(src.numel()) or check(src)
    mgr._dequantize = lambda b, g: stacks.append(list(g.slots)) or dequantize(b, g)
    width = mgr.transit[id(mgr.pools[0])].shape[1]
    runs_seen = 0
    for layer in [L for L in mgr.manifest.layers if L not in mgr.static_maps]:
        s = mgr.begin_stream(layer, list(range(8)))
        assert s is not None
        for p, part in enumerate(s.parts):
            copies.clear(), stacks.clear()
            mgr.stream_part(s, p)
            offs = [mgr.table[ExpertKey(layer, e)].host_offset for e in part]
            runs = 1 + sum(b != a + width for a, b in zip(offs, offs[1:]))
            runs_seen += runs < len(part)
            assert len(copies) == runs and stacks == [s.slots(p)], (part, offs, copies, stacks)
            blob = mgr.manifest.layers[layer].blobs["int8"]
            assert sum(copies) == (len(part) - runs) * width + runs * blob.nbytes
            mgr.wait_part(s, p)
            for e, slot in zip(part, s.slots(p)):
                want = decoded(packed, ExpertKey(layer, e), "int8", device)
                assert all(torch.equal(s.pool.tensors(slot)[n], want[n]) for n in want), f"layer {layer} expert {e}"
            mgr.end_part(s, p)
        mgr.end_stream(s)
    assert runs_seen, "no part had blobs back to back: the test must exercise a coalesced copy"
    _assert_consistent(mgr)


def test_a_streamed_call_reads_its_misses_in_host_pool_order(device, packed_factory):
    """The rebalancer moves warm experts between host places (a demoted expert takes its
    newcomer's place): a streamed call takes its misses in the order of their places, so its
    parts copy as few runs as before such a swap, and each slot still holds its own expert."""
    from test_integrity import decoded

    from tiers.residency import Op

    packed = packed_factory("qwen3_moe")
    mgr = manager_of(tiers.load(packed, _cfg("int8"), device=device, progress=False))
    mgr.stream_direct = False
    copies = []
    check = mgr._check_pinned
    mgr._check_pinned = lambda src: copies.append(src.numel()) or check(src)
    layer = next(L for L in mgr.manifest.layers if L not in mgr.static_maps)

    def stream() -> list[list[int]]:
        copies.clear()
        s = mgr.begin_stream(layer, list(range(8)))
        for p in range(len(s.parts)):
            mgr.stream_part(s, p)
            mgr.wait_part(s, p)
            for e, slot in zip(s.parts[p], s.slots(p)):
                want = decoded(packed, ExpertKey(layer, e), "int8", device)
                assert all(torch.equal(s.pool.tensors(slot)[n], want[n]) for n in want), f"expert {e}"
            mgr.end_part(s, p)
        mgr.end_stream(s)
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
    mgr.table.apply(a, Op.MOVE, offset=ob)
    mgr.table.apply(b, Op.MOVE, offset=oa)
    after = stream()
    offs = [mgr.table[ExpertKey(layer, e)].host_offset for p in after for e in p]
    assert offs == sorted(offs), after
    assert len(copies) == n_copies, "the swap split the parts' runs"
    _assert_consistent(mgr)


def test_a_streamed_int8_part_copies_into_rows_only_after_their_last_dequantization(packed_factory):
    """Recording streams: before a part's first copy the copy stream waits on the last
    dequantization of every transit row the part writes (rows are reused part after part)."""
    from test_engine import _recorded_manager
    from test_slots import waits_between

    mgr, rec, _ = _recorded_manager(packed_factory("qwen3_moe"), staging=4, cpu="int8", cpu_share={"budget": "64MiB"})
    mgr.stream_direct = False
    pid = id(mgr.pools[0])
    check, dequantize = mgr._check_pinned, mgr._dequantize
    mgr._check_pinned = lambda src: rec.order.append(("copy", None, src.numel())) or check(src)
    stacks = []
    mgr._dequantize = lambda b, g: stacks.append((g.row, len(g.slots))) or dequantize(b, g)
    checked = 0
    for layer in [L for L in mgr.manifest.layers if L not in mgr.static_maps] * 2:
        s = mgr.begin_stream(layer, list(range(8)))
        assert s is not None
        for p in range(len(s.parts)):
            before = dict(mgr.transit_done)
            start = len(rec.order)
            mgr.stream_part(s, p)
            row0, k = stacks[-1]
            first = next(i for i in range(start, len(rec.order)) if rec.order[i][0] == "copy")
            for r in range(row0, row0 + k):
                ev = before.get((pid, r))
                if ev is not None:
                    assert waits_between(rec.order, start, first, mgr.copy_stream, ev), f"layer {layer} part {p} row {r}"
                    checked += 1
            mgr.wait_part(s, p)
            mgr.end_part(s, p)
        mgr.end_stream(s)
    assert checked > 4


@pytest.mark.parametrize("tokens", [64, 2])
def test_stage_ahead_stages_the_next_layer_in_order_after_a_long_call(tokens, checkpoint_factory, packed_factory):
    """``stream_ahead`` (off by default): after a streamed call long enough to hit nearly every
    expert, the next layer's first warm experts, in expert order, are staged into half the slots
    just given back (through the copy engine, with direct stacks forced on: the torch
    reference), and that layer's call finds them resident; a short call stages nothing.
    Logits stay equal to the untiered model's."""
    model = tiers.load(packed_factory("qwen3_moe"), WARM, device="cpu", progress=False)
    mgr = manager_of(model)
    assert not mgr.stream_ahead
    mgr.stream_ahead = mgr.direct_reads = True
    mgr.whole_calls = False  # stage_ahead follows calls that wait for their routing
    direct_stacks, stage_direct = [], mgr._stage_direct
    mgr._stage_direct = lambda *a: direct_stacks.append(a) or stage_direct(*a)
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen3_moe"), dtype=torch.bfloat16).eval()
    ref.set_experts_implementation("grouped_mm")
    staged = []
    ahead = mgr.stage_ahead
    layers = sorted(mgr.manifest.layers)

    def spy(layer, *a):
        n = ahead(layer, *a)
        nxt = layers[layers.index(layer) + 1] if layer != layers[-1] else None
        resident = [] if nxt is None else [e for e in range(mgr.manifest.layers[nxt].layout.num_experts)
                                           if not mgr.table[ExpertKey(nxt, e)].pinned and mgr.table[ExpertKey(nxt, e)].slot is not None]
        staged.append((layer, n, resident))
        return n

    mgr.stage_ahead = spy
    first = {}  # layer -> the experts stage_ahead would take, before any call
    for L in layers:
        rows = [mgr.table[ExpertKey(L, e)] for e in range(mgr.manifest.layers[L].layout.num_experts)]
        first[L] = [e for e, r in enumerate(rows) if r.slot is None][: (mgr.stats().gpu_slots["staging"]) // 2]
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    mgr.reset_stats()
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.equal(got, want)
    s = mgr.stats()
    if tokens == 2:  # 8 rows: no call streams, nothing is staged ahead
        assert s.streamed["calls"] == 0 and not staged and s.prefetch["issued"] == 0
        return
    assert [L for L, *_ in staged] == layers, "every layer streams and then stages ahead"
    for i, (_, n, resident) in enumerate(staged[:-1]):  # the next layer's first warm experts, in order
        assert n == len(first[layers[i + 1]]) and resident == first[layers[i + 1]], staged
    assert staged[-1][1] == 0, "nothing after the last layer"
    assert s.prefetch["issued"] == sum(n for _, n, _ in staged) > 0
    assert s.prefetch["used"] > 0, "the next layer's call must find staged experts resident"
    assert not direct_stacks
    _assert_consistent(mgr)


def test_stage_ahead_needs_a_call_long_enough_to_cover_the_next_layer(packed_factory):
    """8 experts, one pick per token: a call of t tokens misses a given expert with chance
    0.875^t, at most 0.1 from t = 18 on (0.875^17 = 0.103); shorter calls stage nothing ahead,
    and nothing is staged while off."""
    mgr = manager_of(tiers.load(packed_factory("qwen3_moe"), WARM, device="cpu", progress=False))
    layers = sorted(mgr.manifest.layers)
    assert mgr.manifest.layers[layers[1]].layout.num_experts == 8
    assert mgr.stage_ahead(layers[0], 64, 1, 2) == 0, "off by default"
    mgr.stream_ahead = True
    assert mgr.stage_ahead(layers[0], 17, 1, 2) == 0 and mgr.stats().prefetch["issued"] == 0
    assert mgr.stage_ahead(layers[0], 18, 1, 2) == 2
    assert mgr.stage_ahead(layers[-1], 64, 1, 2) == 0, "no layer after the last"


def test_a_streamed_call_empties_slots_cached_by_another_layer(device, packed_factory):
    """Staging slots holding another layer's experts (left by a short call) are emptied and
    reserved; those experts leave the GPU, and the output matches the general path's."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg("bf16", fraction=0.25), device=device, progress=False)
    mgr = manager_of(model)
    calls = [c for c in _calls(model, 64, seed=5) if c[0] not in mgr.static_maps]
    (first, _, mod1, x1, idx1, w1), (layer, _, mod, x, idx, w) = calls[:2]
    pool = mgr.pool_of[layer]
    hot = mgr.hot_count[id(pool)]
    mgr.streamed_calls = False
    with torch.no_grad():
        want = mod(x, idx, w)
        mod1(x1[:2], idx1[:2], w1[:2])  # a short call: its misses stay cached
    others = [pool.owner[s] for s in range(hot, pool.n_slots) if pool.owner[s] is not None and pool.owner[s].layer == first]
    assert others, "the short call must leave experts of its layer cached"
    mgr.streamed_calls = True
    mgr.reset_stats()
    with torch.no_grad():
        got = mod(x, idx, w)
    assert mgr.stats().streamed["calls"] == 1
    assert all(mgr.table[k].slot is None for k in others)
    _assert_close(want, got, device, f"layer {layer}")
    _assert_consistent(mgr)


def test_a_call_whose_experts_fill_the_cache_streams_them_from_where_they_are(device, packed_factory):
    """The general path leaves every staging slot holding an expert of the call; the same call
    streamed then reserves every staging slot, reads only the experts not cached (the cached ones
    count as GPU hits), leaves the cache empty, and matches the general path's output."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg("bf16", fraction=0.25), device=device, progress=False)
    mgr = manager_of(model)
    layer, _, mod, x, idx, w = next(c for c in _calls(model, 64, seed=7) if c[0] not in mgr.static_maps)
    pool = mgr.pool_of[layer]
    hot = mgr.hot_count[id(pool)]
    staging = pool.n_slots - hot
    mgr.streamed_calls = False
    with torch.no_grad():
        want = mod(x, idx, w)
    cached = {pool.owner[s] for s in range(hot, pool.n_slots) if pool.owner[s] is not None and pool.owner[s].layer == layer}
    assert len(cached) == staging, "the general path must leave the call's experts in every staging slot"
    used = {ExpertKey(layer, e) for e in idx.unique().tolist()}
    read = [k for k in used if not mgr.table[k].pinned and k not in cached]
    mgr.streamed_calls = True
    begin, plans = mgr.begin_stream, []
    mgr.begin_stream = lambda *a, **kw: plans.append(begin(*a, **kw)) or plans[-1]
    lru, accesses = mgr.cache[id(pool)], []
    access = lru.access
    lru.access = lambda key: accesses.append(key) or access(key)
    mgr.reset_stats()
    with torch.no_grad():
        got = mod(x, idx, w)
    st = mgr.stats()  # a whole-layer call counts here
    assert sorted(accesses) == sorted(k for k in used if not mgr.table[k].pinned), "the policy sees every lookup of a warm expert"
    s = plans[0]
    n = mgr.WHOLE_BUFFERS
    assert s is not None and len(s.buffers) == n and sorted(sum(s.buffers, [])) == list(range(hot, pool.n_slots))
    assert s.preloaded == {k.expert for k in cached} and all(mgr.table[h.key].pinned for h in s.held)
    assert st.streamed["calls"] == st.streamed["whole"] == 1
    assert st.bytes_moved.get("cpu", 0) == sum(mgr.manifest.ref(k, "bf16").nbytes for k in read), "a cached expert was read again"
    assert st.hits["gpu"] == len(used) - len(read) and st.misses["gpu"] == len(read)
    assert all(pool.owner[s] is None for s in range(hot, pool.n_slots)), "reserved slots hold no cache"
    _assert_close(want, got, device, f"layer {layer}")
    _assert_consistent(mgr)



def _used(idx) -> list[int]:
    return sorted(set(idx.reshape(-1).tolist()))


@pytest.mark.parametrize("buffers", [2, 3])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_whole_layer_calls_run_without_a_sync_and_count_when_settled(precision, buffers, device, checkpoint_factory, packed_factory):
    """Calls long enough to route to every expert read their layer's every warm expert with no
    host sync (on CUDA, sync debug mode raises on one) and count nothing until settled; then
    each used expert is one lookup, a cpu hit where it was read, and the outputs equal
    transformers' grouped_mm (bf16; bit-identical on the CPU) or the calls that wait for their
    routing (INT8)."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg(precision), device=device, progress=False)
    mgr = manager_of(model)
    mgr.WHOLE_BUFFERS = buffers
    calls = [c for c in _calls(model, 64, seed=11) if c[0] not in mgr.static_maps]
    assert calls and all(mgr.whole_layer(c[0], *c[4].shape) for c in calls)
    used = [_used(c[4].cpu()) for c in calls]
    read = [[e for e in u if mgr.table[ExpertKey(c[0], e)].slot is None] for c, u in zip(calls, used)]
    if precision == "bf16":
        ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen3_moe"), dtype=torch.bfloat16).to(device).eval()
        ref.set_experts_implementation("grouped_mm")
        with torch.no_grad():
            want = [ref.get_submodule(name)(x, idx, w) for _, name, _, x, idx, w in calls]
    else:
        mgr.whole_calls = False
        with torch.no_grad():
            want = [mod(x, idx, w) for _, _, mod, x, idx, w in calls]
        for (layer, *_), r in zip(calls, read):  # the general path's calls left nothing cached: reserved slots
            assert all(mgr.table[ExpertKey(layer, e)].slot is None for e in r)
        mgr.whole_calls = True
    mgr.reset_stats()
    mgr.UNSETTLED_CALLS = 2  # a whole call counts the landed ones before it once two wait
    mgr.settle_layer = None  # ... and the last layer's call counts nothing after it (tested below)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            got = [mod(x, idx, w) for _, _, mod, x, idx, w in calls]
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    # a call that finds two waiting counts those whose bounds have landed (on the CPU, all of them)
    settled = len(calls) - len(mgr.unsettled)
    assert 0 <= settled < len(calls) and sum(mgr.stats_.hits.values()) == sum(map(len, used[:settled])), "counted before settling"
    if device.type == "cpu":
        assert settled == (2 if len(calls) == 3 else 0), (len(calls), settled)
    s = mgr.stats()
    assert not mgr.unsettled
    assert s.streamed["whole"] == s.streamed["calls"] == len(calls) and s.streamed["unused"] == 0
    assert s.hits["cpu"] == sum(map(len, read)) and s.hits["gpu"] == sum(map(len, used)) - sum(map(len, read))
    blob = mgr.manifest.layers[calls[0][0]].blobs[precision].nbytes
    assert s.bytes_moved["cpu"] == blob * sum(map(len, read))
    for (layer, *_), a, b in zip(calls, want, got):
        _assert_close(a, b, device, f"layer {layer}")
    _assert_consistent(mgr)


@pytest.mark.parametrize("rebalance", [False, True])
def test_the_last_layers_whole_call_counts_the_landed_ones_without_a_sync(rebalance, device, packed_factory, monkeypatch):
    """After a forward's last pooled layer's whole-layer call is queued, the whole-layer calls
    whose rows have landed are counted there, with no host sync (CUDA's sync debug mode raises on
    one): on the CPU, where they land as they run, the whole pass; on CUDA, at least the pass
    before (landed: synchronized), never a call before the last layer's. The counts equal those
    of the same calls settled by ``stats``. With the rebalancer, the intervals those counts close
    rebalance there too, and, no direct call having run since, none reads direct decode's device
    counts (a sync)."""
    cfg = _cfg("bf16")
    if rebalance:
        cfg["tiers"]["rebalance"] = {"every_tokens": 8}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device=device, progress=False)
    mgr = manager_of(model)
    taken = []
    if rebalance:  # direct decode's tables built, as after a generate
        if device.type == "cpu":
            mgr.direct_decode = True  # the torch reference stands in for the kernel
        mgr.begin_decode()
        mgr.end_decode()
        assert mgr._direct_layers
        take = mgr.take_direct_usage
        monkeypatch.setattr(mgr, "take_direct_usage", lambda: taken.append(take()) or taken[-1])
    calls = [c for c in _calls(model, 64, seed=11) if c[0] not in mgr.static_maps]
    assert len(calls) >= 2 and all(mgr.whole_layer(c[0], *c[4].shape) for c in calls)
    assert mgr.settle_layer == calls[-1][0]
    mgr.UNSETTLED_CALLS = 1 << 30  # only the last layer's rule counts
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
        assert not mgr.unsettled and sum(mgr.stats_.hits.values()) == sum(map(len, used))
    counted = sum(mgr.stats_.hits.values())
    if device.type == "cuda":
        torch.cuda.synchronize()  # the first pass's rows have landed
    run(debug=True)
    first = sum(mgr.stats_.hits.values())
    assert first >= sum(map(len, used)), "the pass before was not counted at the last layer"
    assert len(mgr.unsettled) <= len(calls)
    s = mgr.stats()
    assert not mgr.unsettled and sum(s.hits.values()) == 2 * sum(map(len, used))
    assert s.streamed["whole"] == 2 * len(calls)
    if rebalance:
        assert s.rebalance["rebalances"] > 0 and taken and all(t is None for t in taken), taken
        mgr.rebalancer.land(wait=True)
    _assert_consistent(mgr)


@pytest.mark.parametrize("on_copy", [True, False])
def test_a_whole_layer_call_uploads_its_plan_on_the_copy_stream_before_its_reads(on_copy, device, packed_factory):
    """The plan's upload goes on the copy stream ahead of the first part's reads (on the compute
    stream it would wait for the copy engine to finish them; ``WHOLE_PLAN_ON_COPY`` off puts it
    there, for A/B runs), and the output is unchanged either way."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg("bf16", fraction=0.25), device=device, progress=False)
    mgr = manager_of(model)
    mgr.WHOLE_PLAN_ON_COPY = on_copy
    layer, _, mod, x, idx, w = next(c for c in _calls(model, 64, seed=2) if c[0] not in mgr.static_maps)
    assert mgr.whole_layer(layer, *idx.shape)
    mgr.whole_calls = False
    with torch.no_grad():
        want = mod(x, idx, w)
    mgr.whole_calls = True
    log = []
    upload, part = mgr.upload_int_lists, mgr.stream_part
    mgr.upload_int_lists = lambda lists, on=None: log.append(("upload", on)) or upload(lists, on=on)
    mgr.stream_part = lambda s, p: log.append(("read", p)) or part(s, p)
    with torch.no_grad():
        got = mod(x, idx, w)
    assert mgr.stats().streamed["whole"] == 1
    assert log[0] == ("upload", mgr.copy_stream if on_copy else None) and ("read", 0) in log
    _assert_close(want, got, device, f"layer {layer}")


def test_a_whole_layer_call_counts_the_experts_it_read_in_vain(device, packed_factory):
    """Routing that leaves some warm experts without a row: the call still reads them (it plans
    without the routing), counts them as read in vain with their bytes, and not as lookups; the
    cache policy's visit and lookups see only the used experts, as a call that waits would."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg("bf16", fraction=0.25), device=device, progress=False)
    mgr = manager_of(model)
    layer, _, mod, x, idx, w = next(c for c in _calls(model, 64, seed=2) if c[0] not in mgr.static_maps)
    warm = [e for e in range(8) if mgr.table[ExpertKey(layer, e)].slot is None]
    unused = warm[:2]
    keep = [e for e in range(8) if e not in unused]
    g = torch.Generator().manual_seed(4)
    idx = torch.stack([torch.tensor(keep)[torch.randperm(len(keep), generator=g)[:2]] for _ in range(64)]).to(idx.device)
    lru = mgr.cache[id(mgr.pool_of[layer])]
    visits, accesses = [], []
    visit, access = lru.visit, lru.access
    lru.visit = lambda L, keys: visits.append((L, [k.expert for k in keys])) or visit(L, keys)
    lru.access = lambda key: accesses.append(key.expert) or access(key)
    mgr.reset_stats()
    with torch.no_grad():
        mod(x, idx, w)
    assert not visits and not accesses, "counted before settling"
    s = mgr.stats()
    blob = mgr.manifest.layers[layer].blobs["bf16"].nbytes
    assert s.streamed["whole"] == 1 and s.streamed["unused"] == len(unused) and s.streamed["unused_bytes"] == blob * len(unused)
    assert s.bytes_moved["cpu"] == blob * len(warm), "every warm expert was read"
    assert s.hits["cpu"] == len(warm) - len(unused) and s.hits["gpu"] == len(keep) - (len(warm) - len(unused))
    assert visits == [(layer, _used(idx.cpu()))]
    assert sorted(accesses) == sorted(e for e in warm if e not in unused)
    assert "read their whole layer without a sync" in str(s)
    # that call used too few of the warm experts: the layer's next long call waits for its routing
    # and reads only what it uses; one that uses them all makes the next one whole again
    assert mgr.used_share[layer] == (len(warm) - len(unused)) / len(warm) < mgr.WHOLE_LAYER_USED
    assert not mgr.whole_layer(layer, *idx.shape)
    mgr.reset_stats()
    with torch.no_grad():
        mod(x, idx, w)
    s = mgr.stats()
    assert s.streamed["whole"] == 0 and s.bytes_moved["cpu"] <= blob * (len(warm) - len(unused))
    full = _calls(model, 64, seed=2)
    _, _, _, x2, idx2, w2 = next(c for c in full if c[0] == layer)
    assert len(_used(idx2.cpu())) == 8
    with torch.no_grad():
        mod(x2, idx2, w2)
    assert mgr.used_share[layer] == 1.0 and mgr.whole_layer(layer, *idx2.shape)


@pytest.mark.parametrize("buffers", [2, 3])
def test_whole_layer_calls_settle_in_call_order_and_only_once_landed(buffers, packed_factory):
    """Recording streams: ``settle(block=False)`` counts the calls whose bounds have landed, in
    order, and stops at the first that has not; a call that waits for its routing settles every
    call before it first. A whole call's first reads into each buffer wait on that buffer's
    slots' last reads, not on an event recorded after the kernels queued before the call; its
    buffers go in the order the previous call's last parts used them (the earliest first)."""
    import tiers.integration as integ
    from test_engine import _recorded_manager

    mgr, rec, _ = _recorded_manager(packed_factory("qwen3_moe"), staging=4, cpu="bf16", cpu_share={"budget": "64MiB"})
    mgr.WHOLE_BUFFERS = buffers
    layers = [L for L in sorted(mgr.manifest.layers) if L not in mgr.static_maps]
    order = []
    count = mgr._count_whole
    mgr._count_whole = lambda s: order.append(s.layer) or count(s)
    streams, reordered = [], []
    for i, L in enumerate(layers * 2):
        # seven or eight experts: parts that end in different buffers, which the next call must read into last
        s = mgr.begin_stream(L, list(range(7 if i % 2 == 0 else 8)), whole=(64, 2))
        assert s is not None and s.whole is not None
        if streams:  # the buffers are the previous call's, first the one its last kernels read first
            prev = streams[-1]
            n = len(prev.buffers)
            assert n == mgr.WHOLE_BUFFERS and sorted(s.buffers) == sorted(prev.buffers)
            last = [max(p for p in range(len(prev.parts)) if p % n == prev.buffers.index(b)) for b in s.buffers]
            assert last == sorted(last)
            # each buffer's first reads wait on the event after the previous call's last part in it
            assert all(s.freed[i] == [prev.freed[prev.buffers.index(b)][0]] for i, b in enumerate(s.buffers))
            assert not set(s.slots(0)) & set(prev.slots(len(prev.parts) - 1))
            reordered.append(s.buffers != prev.buffers)
        for p in range(len(s.parts)):
            mgr.stream_part(s, p)
            mgr.wait_part(s, p)
            mgr.end_part(s, p)
        mgr.end_stream(s)
        mgr.defer_whole(s, torch.zeros(0, dtype=torch.int64), [])
        streams.append(s)

    class Pending:
        def __init__(self):
            self.landed = False

        def query(self):
            return self.landed

        def synchronize(self):
            self.landed = True

    gates = [Pending() for _ in streams]
    for s, gate in zip(streams, gates):
        s.whole.done = gate
    gates[0].landed = gates[2 % len(gates)].landed = True
    mgr.settle(block=False)
    assert order == layers[:1], "stops at the first call not landed"
    mgr.settle()
    assert order == layers * 2 and not mgr.unsettled and all(g.landed for g in gates)
    assert any(reordered), "some call must end its parts in a buffer other than the last"
    assert integ  # the integration path calls settle before any call that waits (test_whole_layer_calls_run...)


@pytest.mark.parametrize("held_after", [-1, 1])
@pytest.mark.parametrize("n_parts", [2, 3, 7])
@pytest.mark.parametrize("buffers", [2, 3])
def test_run_parts_reads_each_part_as_soon_as_its_buffer_is_free(buffers, n_parts, held_after):
    """``_run_parts``' schedule, the first parts' reads queued by the caller: every part is read
    once; part q's reads come after the kernels of part q - n (the last user of its buffer, n
    buffers) and before the kernels of part q - n + 1, so the copy engine reads one part ahead of
    each buffer's reuse; each part's kernels wait for its reads; the held experts run after
    part ``held_after`` (-1: before every part)."""
    from types import SimpleNamespace

    from tiers.integration import _run_parts

    log = []
    mgr = SimpleNamespace(stream_part=lambda s, p: log.append(("read", p)), wait_part=lambda s, p: log.append(("wait", p)),
                          end_part=lambda s, p: log.append(("end", p)), wait_all=lambda held: log.append(("held", None)))
    s = SimpleNamespace(buffers=tuple([] for _ in range(buffers)), parts=[[q] for q in range(n_parts)], held=[])
    for q in range(min(buffers, n_parts)):
        mgr.stream_part(s, q)
    held_after = min(held_after, n_parts - 1)
    _run_parts(mgr, s, lambda g: log.append(("run", g)), held_after)
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


def test_a_buffer_no_part_used_keeps_its_slots_last_reads(packed_factory):
    """A whole call with fewer parts than buffers: the slots of a buffer no part read into go
    back unheld with the last reads they had (each its own), not an event of this call."""
    from test_engine import _recorded_manager

    mgr, rec, streams = _recorded_manager(packed_factory("qwen3_moe"), staging=4, cpu="bf16", cpu_share={"budget": "64MiB"})
    mgr.WHOLE_BUFFERS = 3
    layer = next(L for L in sorted(mgr.manifest.layers) if L not in mgr.static_maps)
    pool = mgr.pool_of[layer]
    hot = mgr.hot_count[id(pool)]
    before = {}
    for slot in range(hot, pool.n_slots):  # a distinct last read per slot
        ev = streams.event()
        ev.record(streams.current())
        pool.last_read[slot] = before[slot] = ev
    warm = [e for e in range(8) if not mgr.table[ExpertKey(layer, e)].pinned]
    s = mgr.begin_stream(layer, warm[:2], whole=(64, 2))  # two misses: buffers of 1, 1 and 2 slots
    assert s is not None and [len(b) for b in s.buffers] == [1, 1, 2] and len(s.parts) == 2
    for p in range(len(s.parts)):
        mgr.stream_part(s, p)
        mgr.wait_part(s, p)
        mgr.end_part(s, p)
    mgr.end_stream(s)
    assert all(pool.last_read[slot] is before[slot] for slot in s.buffers[2])
    assert all(pool.last_read[slot] is s.freed[i][0] for i in range(2) for slot in s.buffers[i])
    assert all(pool.readers[slot] == 0 for slot in range(hot, pool.n_slots))


def test_whole_layer_calls_need_long_calls_within_the_row_cap(packed_factory):
    """A whole-layer call needs more rows than a host-routed call and at most WHOLE_LAYER_ROWS,
    a call long enough that uniform routing would use every expert but with chance 1e-3, and
    neither generate's decode stage, a recorded routing trace, nor the switch off."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg("bf16"), device="cpu", progress=False)
    mgr = manager_of(model)
    layer = next(L for L in mgr.manifest.layers if L not in mgr.static_maps)
    assert mgr.whole_layer(layer, 64, 2)
    assert not mgr.whole_layer(layer, 32, 2), "64 rows: routed on the host"
    assert mgr.long_call(layer, 25, 2) and not mgr.long_call(layer, 24, 2)  # 0.75^25 <= 1e-3 < 0.75^24
    assert mgr.whole_layer(layer, 40, 2) and mgr.long_call(layer, 40, 2)
    mgr.WHOLE_LAYER_ROWS = 127
    assert not mgr.whole_layer(layer, 64, 2), "128 rows over the cap"
    mgr.WHOLE_LAYER_ROWS = 128
    assert mgr.whole_layer(layer, 64, 2)
    for attr, value in (("decoding", True), ("recorded", []), ("whole_calls", False), ("streamed_calls", False)):
        old = getattr(mgr, attr)
        setattr(mgr, attr, value)
        assert not mgr.whole_layer(layer, 64, 2), attr
        setattr(mgr, attr, old)


def test_a_whole_layer_call_runs_its_held_experts_after_parts_0_and_1(packed_factory):
    """The held experts' kernels follow parts 0 and 1 (read first, during the layer before), so
    part 2's reads, which wait for part 0's kernels, run while they do."""
    model = tiers.load(packed_factory("qwen3_moe"), _cfg("bf16"), device="cpu", progress=False)
    mgr = manager_of(model)
    layer, _, mod, x, idx, w = next(c for c in _calls(model, 64, seed=5) if c[0] not in mgr.static_maps)
    order = []
    end_part, wait_all = mgr.end_part, mgr.wait_all
    mgr.end_part = lambda s, p: order.append(p) or end_part(s, p)
    mgr.wait_all = lambda held: order.append("held") or wait_all(held)
    with torch.no_grad():
        mod(x, idx, w)
    assert mgr.stats().streamed["whole"] == 1
    assert len(order) > 3 and order[:3] == [0, 1, "held"] and order[3:] == list(range(2, len(order) - 1))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_whole_layer_calls_through_graphs_equal_the_eager_calls(precision, device, packed_factory):
    """With ``whole_graphs`` on (by default with CUDA), a whole-layer call's plan and windows run
    eagerly, then are captured, then replay (on the CPU through ``HostGraph``): every call's
    output equals the same call's through the path that waits for its routing, inputs changing
    between calls of the same shapes (rows routed to the sentinel id among them, which no window
    writes), and the calls count as before."""
    from tiers.graphs import DecodeGraphs

    model = tiers.load(packed_factory("qwen3_moe"), _cfg(precision), device=device, progress=False)
    mgr = manager_of(model)
    rounds = [[c for c in _calls(model, 64, seed=seed) if c[0] not in mgr.static_maps] for seed in (11, 12, 11, 13, 14, 12)]
    for r, calls in enumerate(rounds[1:], 1):  # some picks to the sentinel id (expert parallelism), others each round
        for *_, mod, _, idx, _ in calls:
            idx[r::7, r % idx.shape[1]] = mod.num_experts
    assert rounds[0] and all(mgr.whole_layer(c[0], *c[4].shape) for c in rounds[0])
    assert mgr.whole_graphs.enabled == (device.type == "cuda")  # on by default with CUDA
    mgr.whole_calls = False  # the reference: the calls that wait for their routing
    with torch.no_grad():
        want = [[mod(x, idx, w) for _, _, mod, x, idx, w in calls] for calls in rounds]
    mgr.whole_calls = True
    mgr.whole_graphs = DecodeGraphs(device, True)
    mgr.reset_stats()
    with torch.no_grad():
        got = [[mod(x, idx, w) for _, _, mod, x, idx, w in calls] for calls in rounds]
    for r, (a_round, b_round) in enumerate(zip(want, got)):
        for (layer, *_), a, b in zip(rounds[r], a_round, b_round):
            _assert_close(a, b, device, f"round {r}, layer {layer}")
    s = mgr.stats()
    counts = s.whole_graphs
    assert counts == mgr.whole_graphs.counts() and "their plans and windows" in str(s)
    assert counts["failed"] == 0 and counts["captured"] > 0 and counts["replayed"] > counts["captured"], counts
    assert s.streamed["whole"] == s.streamed["calls"] == sum(map(len, rounds))
    _assert_consistent(mgr)


def test_whole_layer_outputs_keep_the_last_two_shapes(packed_factory):
    from tiers.graphs import DecodeGraphs

    model = tiers.load(packed_factory("qwen3_moe"), _cfg("int8"), progress=False)
    mgr = manager_of(model)
    assert mgr.whole_out((4, 2), torch.float32, torch.device("cpu")) is not mgr.whole_out((4, 2), torch.float32, torch.device("cpu"))
    mgr.whole_graphs = DecodeGraphs(torch.device("cpu"), True)
    a = mgr.whole_out((4, 2), torch.float32, torch.device("cpu"))
    b = mgr.whole_out((5, 2), torch.float32, torch.device("cpu"))
    assert mgr.whole_out((4, 2), torch.float32, torch.device("cpu")) is a  # kept while its shape recurs
    mgr.whole_out((6, 2), torch.float32, torch.device("cpu"))  # a third shape: the least recent (5, 2) goes
    assert mgr.whole_out((4, 2), torch.float32, torch.device("cpu")) is a
    assert mgr.whole_out((5, 2), torch.float32, torch.device("cpu")) is not b


def _fake_stream(n_slots: int, held: dict[int, int], parts: list[dict[int, int]]):
    """What ``_whole_plan`` reads of a stream: the pool's slot count, the held experts' slots,
    and each part's experts and slots (``{slot: expert}``)."""
    from types import SimpleNamespace

    handles = [SimpleNamespace(slot=slot, key=ExpertKey(0, e)) for slot, e in held.items()]
    return SimpleNamespace(pool=SimpleNamespace(n_slots=n_slots), held=handles,
                           parts=[list(p.values()) for p in parts], slots=lambda p: list(parts[p]))


def test_a_whole_plans_windows_do_not_move_with_the_other_windows():
    """A window's first bound is its group's and first slot's alone: when the held experts' slots
    change (a rebalance), the parts' windows keep their bounds, so their graphs stay valid; and
    every expert's rows end at the bound after its own (group, slot)."""
    from tiers.integration import _whole_plan

    parts = [{12: 5, 13: 6, 14: 7}, {16: 8, 17: 9}]
    a = _whole_plan(_fake_stream(20, {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}, parts), 10)
    b = _whole_plan(_fake_stream(20, {2: 0, 19: 1, 3: 2, 4: 3, 5: 4}, parts), 10)  # other slots, split by WINDOW_GAP
    assert a.n_groups == b.n_groups == 3
    assert [seg for seg in a.segments if seg[0] > 0] == [seg for seg in b.segments if seg[0] > 0] == [(1, 12, 15, 33), (2, 16, 18, 58)]
    assert a.segments[0] == (0, 0, 5, 0) and b.segments[:2] == [(0, 2, 6, 2), (0, 19, 20, 19)]
    ends = dict(b.ends)
    assert ends == {0: 3, 1: 20, 2: 4, 3: 5, 4: 6, 5: 34, 6: 35, 7: 36, 8: 59, 9: 60}
    assert b.key_of[1] == 19 and b.key_of[8] == 2 * 20 + 16 and b.key_of[10] > 3 * 20  # the sentinel after every group
