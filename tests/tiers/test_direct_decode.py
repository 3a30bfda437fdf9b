"""Direct decode: in generate's decode stage, qualifying layers read their misses from the pinned
pool on the device (quant.direct), with no host sync and no staging.

On CUDA the path is on by default and the logits are bit-identical to the untiered model's
batched_mm decode (bf16 tiers). On the CPU, where transformers keeps grouped_mm, the decode
switch and the direct path are forced to run the same logic through the torch reference.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiers
from tiers.loader.layout import ExpertKey
from tiers.integration import manager_of
from tiers.residency import Home, Op

from test_end_to_end import GEN, assert_decode_logits, prompt

# a few experts hot per layer, every other one warm in bf16; 8 staging slots, all reserved for direct misses
# (every layer qualifies)
DIRECT_BF16 = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}}


def _load(packed, cfg, device, *, direct=True):
    # step graphs off: these tests spy on the direct calls one by one (tests/tiers/test_step_graph.py
    # checks the same calls inside whole-step graphs against them)
    t = cfg["tiers"]
    cfg = {"tiers": t | {"gpu": t.get("gpu", {}) | {"step_graphs": False}}}
    model = tiers.load(packed, cfg, device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True  # what a GPU does; forced on the CPU
    if device.type == "cpu":
        mgr.direct_decode = mgr.cfg.cpu.direct_reads  # the torch reference stands in for the kernel
    assert mgr.direct_decode == direct
    return model, mgr


def _count_direct(monkeypatch, mgr):
    calls = []
    fetch = mgr.fetch_direct
    monkeypatch.setattr(mgr, "fetch_direct", lambda layer, idx: calls.append(layer) or fetch(layer, idx))
    return calls


def _check_misses(monkeypatch, mgr, packed, precision: str, device) -> list[int]:
    """Spy on direct calls: after each, every missed pick's slot must hold exactly its blob in
    ``precision``, decoded alone; returns the list the checked misses are appended to."""
    from test_integrity import decoded

    checked: list[int] = []
    fetch = mgr.fetch_direct

    def check(layer, idx):
        ids = fetch(layer, idx)
        pool = mgr.pool_of[layer]
        for e, slot in zip(idx.reshape(-1).tolist(), ids.reshape(-1).tolist()):
            if not mgr.table[ExpertKey(layer, e)].pinned:
                want = decoded(packed, ExpertKey(layer, e), precision, device)
                for name, t in pool.tensors(slot).items():
                    assert torch.equal(t, want[name]), f"layer {layer} expert {e} {name}"
                checked.append(e)
        return ids

    monkeypatch.setattr(mgr, "fetch_direct", check)
    return checked


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_direct_decode_matches_untiered_decode(model_type, device, checkpoint_factory, packed_factory, monkeypatch):
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory(model_type), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    model, mgr = _load(packed_factory(model_type), DIRECT_BF16, device)
    calls = _count_direct(monkeypatch, mgr)
    layers = len(mgr.manifest.layers)
    ids = prompt(device)  # 2 sequences x top-2: 4 picks per call, half the reserved slots
    a = ref.generate(ids, **GEN)
    mgr.reset_stats()
    b = model.generate(ids, **GEN)
    steps = GEN["max_new_tokens"] - 1
    assert len(calls) == layers * steps, "every decode step of every layer must run direct"
    assert torch.equal(a.sequences, b.sequences)
    assert_decode_logits(a, b, device)
    s = mgr.stats()
    assert s.direct["decode_calls"] == layers * steps
    assert "direct reads: %d decode layer calls" % (layers * steps) in str(s) and s.as_dict()["direct"] == s.direct
    lookups = sum(s.hits.values())
    prefill_lookups = lookups - layers * steps * 4
    assert s.hits["cpu"] > 0 and prefill_lookups > 0
    blob = mgr.manifest.layers[0].blobs["bf16"].nbytes
    assert s.bytes_moved["cpu"] == blob * s.hits["cpu"], "every cpu hit moves one blob"
    assert s.misses["gpu"] == s.hits["cpu"] + s.hits["nvme"]
    # the reserved slots are given back, empty, with nobody holding them
    assert not mgr._reserved and all(r == 0 for p in mgr.pools for r in p.readers)
    # ... and the host-routed path works after the decode stage: a second generate matches too
    c = model.generate(ids, **GEN)
    assert torch.equal(a.sequences, c.sequences)
    assert_decode_logits(a, c, device)


def _cache_model(calls, lanes: int, rows: int, row_of, pinned) -> tuple[int, int, int]:
    """(resident, decoded, cached) picks of ``calls`` [(layer, experts)] through a cache of
    ``lanes`` slots by the victim rule of ``quant.direct.plan``, written out here on its own:
    an empty lane, else the lane whose expert's row comes back last, then the least recently used."""
    held: list = [None] * lanes  # (row, expert) per lane
    last = [0] * lanes
    n, clock = [0, 0, 0], 0
    for layer, experts in calls:
        row, used = row_of[layer], set()
        for e in experts:
            clock += 1
            if pinned(layer, e):
                n[0] += 1
                continue
            if (row, e) in held:
                i = held.index((row, e))
                n[2] += 1
            else:
                free = [i for i in range(lanes) if i not in used]
                empty = [i for i in free if held[i] is None]
                if empty:
                    i = empty[0]
                else:
                    back = {i: (held[i][0] - row - 1) % rows for i in free}
                    far = max(back.values())
                    i = min((i for i in free if back[i] == far), key=lambda i: last[i])
                held[i] = (row, e)
                n[1] += 1
            last[i] = clock
            used.add(i)
    return tuple(n)


def test_direct_counts_resident_decoded_and_cached_picks(device, checkpoint_factory, packed_factory, monkeypatch):
    """Each direct call's picks: resident (hot) ones and those the reserved slots still hold count
    as gpu hits, the others as cpu hits that moved one blob each; checked against the routing the
    calls saw, through a model of the slot cache written in the test."""
    model, mgr = _load(packed_factory("mixtral"), DIRECT_BF16, device)
    seen, lanes = [], set()
    fetch = mgr.fetch_direct

    def spy(layer, idx):
        seen.append((layer, idx.reshape(-1).tolist()))
        lanes.add(len(mgr._reserved[id(mgr.pool_of[layer])].slots))
        return fetch(layer, idx)

    monkeypatch.setattr(mgr, "fetch_direct", spy)
    model.generate(prompt(device), **GEN)
    mgr.reset_stats()
    seen.clear()
    model.generate(prompt(device, batch=1), **GEN)
    d_gpu, d_cpu, d_bytes, _ = mgr.direct_served()
    grid = mgr.table.grid
    (lane_count,) = lanes
    assert lane_count == 8, "every layer runs direct: all 8 staging slots are reserved"
    hot, decoded, cached = _cache_model(seen, lane_count, len(grid.layers), grid.row, lambda L, e: mgr.table[ExpertKey(L, e)].pinned)
    assert cached > 0, "the reserved slots kept nothing across steps"
    assert (d_gpu, d_cpu) == (hot + cached, decoded)
    assert d_bytes == d_cpu * mgr.manifest.layers[0].blobs["bf16"].nbytes


def test_direct_int8_misses_hold_the_decoded_blob(device, checkpoint_factory, packed_factory, monkeypatch):
    """INT8 warm tier: after a direct call, each missed pick's slot holds exactly what the scheme
    decodes from the expert's blob; logits stay close to bf16 (the INT8 bound of the end-to-end tests)."""
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "int8"}, "nvme": {"precision": "int8"}}}
    packed = packed_factory("qwen3_moe")
    model, mgr = _load(packed, cfg, device)
    checked = _check_misses(monkeypatch, mgr, packed, "int8", device)
    model.generate(prompt(device, batch=1), **GEN)
    assert checked, "no miss was read directly"


@pytest.mark.parametrize("case", ["cold", "recording", "off", "too_many_picks", "decode_bytes"])
def test_direct_decode_falls_back_to_host_routing(case, device, checkpoint_factory, packed_factory, monkeypatch):
    """Layers that cannot run direct keep the host-routed path, still matching the untiered model."""
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}}
    batch = 2
    if case == "cold":
        cfg["tiers"]["cpu"] = {"fraction": 0.2, "precision": "bf16"}  # some experts of every layer on disk
    if case == "too_many_picks":
        batch = 5  # 10 picks per call, 8 reserved slots: the first call gives them back
    if case == "decode_bytes":
        from tiers.engine import TierManager

        monkeypatch.setattr(TierManager, "DECODE_BYTES", 1024)  # direct decode bounded below these experts' size
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    if case == "off":
        cfg["tiers"]["cpu"]["direct_reads"] = False
    model, mgr = _load(packed_factory("mixtral"), cfg, device, direct=case != "off")
    if case == "cold":
        assert all(any(mgr.table[ExpertKey(L, e)].home is Home.NVME for e in range(8)) for L in mgr.manifest.layers)
    if case == "recording":
        mgr.recorded = []
    calls = _count_direct(monkeypatch, mgr)
    ids = prompt(device, batch=batch)
    a, b = ref.generate(ids, **GEN), model.generate(ids, **GEN)
    assert calls == []
    assert not mgr._reserved and all(r == 0 for p in mgr.pools for r in p.readers)
    assert torch.equal(a.sequences, b.sequences)
    assert_decode_logits(a, b, device)


@pytest.mark.parametrize("large", [True, False])
def test_decode_stages_choose_their_path_by_the_last_stages_miss_bytes(large, device, checkpoint_factory, packed_factory, monkeypatch):
    """Experts the host-routed path would copy (above ``STACK_BYTES``): a stage whose layer calls
    missed ``DIRECT_MISS_BYTES`` or more on average sends the next stage host-routed, and one that
    missed less sends it back direct; the mean is the stage's miss bytes over its decode layer
    calls, whichever path served them. Small experts (direct stacks) stay direct. Every stage
    matches the untiered model."""
    from tiers.engine import TierManager

    if large:
        monkeypatch.setattr(TierManager, "STACK_BYTES", 1024)
    monkeypatch.setattr(TierManager, "DIRECT_MISS_BYTES", 1)  # any miss: host-routed next
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    model, mgr = _load(packed_factory("mixtral"), DIRECT_BF16, device)
    calls = _count_direct(monkeypatch, mgr)
    reads, begun = [], []
    count_read, begin_call = mgr._count_read, mgr.begin_call
    monkeypatch.setattr(mgr, "_count_read", lambda source, n, t0: reads.append((mgr.decoding, n)) or count_read(source, n, t0))
    monkeypatch.setattr(mgr, "begin_call", lambda *a, **k: begun.append(mgr.decoding) or begin_call(*a, **k))
    (pid,) = {id(p) for p in mgr.pools}
    layers, steps = len(mgr.manifest.layers), GEN["max_new_tokens"] - 1
    ids = prompt(device, batch=1)
    a = ref.generate(ids, **GEN)

    def generate():
        calls.clear(), reads.clear(), begun.clear()
        mgr.reset_stats()
        b = model.generate(ids, **GEN)
        assert torch.equal(a.sequences, b.sequences)
        assert_decode_logits(a, b, device)

    generate()  # the first stage runs direct
    assert len(calls) == layers * steps and not any(begun)
    _, _, moved, _ = mgr.direct_served()
    assert moved > 0 and mgr.decode_miss_bytes[pid] == moved / (layers * steps)
    generate()
    if not large:  # read by direct stacks either way: direct stays
        assert len(calls) == layers * steps and not mgr.host_routed_pools
        return
    assert calls == [] and mgr.host_routed_pools == {pid}
    decode_bytes = sum(n for decoding, n in reads if decoding)
    assert sum(begun) == layers * steps and decode_bytes > 0
    assert mgr.decode_miss_bytes[pid] == decode_bytes / (layers * steps)
    monkeypatch.setattr(TierManager, "DIRECT_MISS_BYTES", decode_bytes)  # the last stage's mean is below it: direct again
    generate()
    assert len(calls) == layers * steps and not mgr.host_routed_pools


def test_large_experts_decode_direct_when_unbounded_exactly_without_stacks(device, checkpoint_factory, packed_factory, monkeypatch):
    """With ``DECODE_BYTES`` unbounded, experts above ``STACK_BYTES`` (as Mixtral-8x7B's in the
    bench) decode direct, each miss's slot holding exactly its blob, and the logits match the
    untiered model's; the staging path copies them (no direct stack), as it does large experts."""
    from tiers.engine import TierManager

    monkeypatch.setattr(TierManager, "STACK_BYTES", 1024)
    monkeypatch.setattr(TierManager, "DECODE_BYTES", None)
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    packed = packed_factory("mixtral")
    model, mgr = _load(packed, DIRECT_BF16, device)
    assert mgr.manifest.layers[0].blobs["bf16"].nbytes > TierManager.STACK_BYTES
    misses, stacked = _check_misses(monkeypatch, mgr, packed, "bf16", device), []
    monkeypatch.setattr(mgr, "fetch_stack", lambda *a: stacked.append(a))
    ids = prompt(device)
    a, b = ref.generate(ids, **GEN), model.generate(ids, **GEN)
    assert misses, "no miss was read directly"
    assert stacked == [] and mgr.stats().direct["stacks"] == 0
    assert torch.equal(a.sequences, b.sequences)
    assert_decode_logits(a, b, device)


def test_direct_decode_with_the_rebalancer(device, checkpoint_factory, packed_factory, monkeypatch):
    """The rebalancer on: direct calls count their picks on the device, the rebalancer takes the
    counts once per interval (exactly the picks of the direct calls since the last take), swaps
    land between forwards and the device tables follow them; the logits still match the
    untiered model's (bf16 tiers)."""
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    cfg = {"tiers": DIRECT_BF16["tiers"] | {"rebalance": {"every_tokens": 2, "margin": 0.0, "significance": 0.0, "window": 2}}}
    model, mgr = _load(packed_factory("mixtral"), cfg, device)
    picks: Counter = Counter()
    taken: Counter = Counter()
    fetch, take = mgr.fetch_direct, mgr.take_direct_usage

    def spy_fetch(layer, idx):
        ids = fetch(layer, idx)
        if ids is not None:
            picks.update(ExpertKey(layer, e) for e in idx.reshape(-1).tolist())
        return ids

    def spy_take():
        got = take()
        if got is not None:
            taken.update(mgr.table.grid.counter(got))
        return got

    monkeypatch.setattr(mgr, "fetch_direct", spy_fetch)
    monkeypatch.setattr(mgr, "take_direct_usage", spy_take)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    kw = GEN | {"max_new_tokens": 24, "min_new_tokens": 24}
    a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert_decode_logits(a, b, device)
    s = mgr.stats()
    assert s.rebalance["promoted_hot"] > 0 and sum(picks.values()) > 0
    assert sum(taken.values()) > 0, "the rebalancer must take the device counts when an interval closes"
    assert taken + mgr.table.grid.counter(take()) == picks, "the device counts must be exactly the direct calls' picks"
    # the device tables follow the residency table after the swaps
    mgr.begin_decode()
    assert mgr._direct_version == mgr.table.homes_version
    for layer, d in mgr._direct_layers.items():
        for e, (slot, start) in enumerate(zip(d.resident.tolist(), d.starts.tolist())):
            r = mgr.table[ExpertKey(layer, e)]
            assert slot == (r.slot if r.pinned else -1) and (r.pinned or start == r.host_offset)
    # a rebuild with nothing moved keeps every layer's tables, uploading nothing; a move rewrites
    # the tables in place (the decode graphs keep their addresses)
    built, uploads, upload = dict(mgr._direct_layers), [], mgr._upload_direct_tables
    monkeypatch.setattr(mgr, "_upload_direct_tables", lambda: uploads.append(1) or upload())
    assert all(mgr._build_direct()[L] is d for L, d in built.items()) and not uploads
    layer = next(iter(built))
    a, b = [k for k in mgr.keys_of[id(mgr.pool_of[layer])] if k.layer == layer and mgr.table[k].home is Home.CPU][:2]
    places = mgr.table[a].host_offset, mgr.table[b].host_offset
    mgr.table.apply(a, Op.MOVE, offset=places[1])  # the two trade places (in the table only: nothing decodes after)
    mgr.table.apply(b, Op.MOVE, offset=places[0])
    starts = built[layer].starts.data_ptr()
    rebuilt = mgr._build_direct()[layer]
    assert rebuilt.starts.data_ptr() == starts and len(uploads) == 1
    assert rebuilt.starts[[a.expert, b.expert]].tolist() == [places[1], places[0]]
    mgr.end_decode()
    mgr.close()


def test_the_rebalancer_reads_the_direct_counts_only_after_a_direct_call(device, packed_factory, monkeypatch):
    """The device's direct-decode counts are read (a sync) only when a direct call ran since the
    last take: an interval that only long prompts closed takes nothing and reads nothing."""
    cfg = {"tiers": DIRECT_BF16["tiers"] | {"rebalance": {"every_tokens": 2}}}
    model, mgr = _load(packed_factory("mixtral"), cfg, device)
    mgr.begin_decode()  # builds the direct tables
    assert mgr._direct_layers
    reads = []
    usage = mgr._usage

    class Spy:
        def reshape(self, *a):
            reads.append(1)
            return usage.reshape(*a)

        def zero_(self):
            return usage.zero_()
    monkeypatch.setattr(mgr, "_usage", Spy())
    assert mgr.take_direct_usage() is None and not reads, "nothing ran: nothing to read"
    layer = next(iter(mgr._direct_layers))
    idx = torch.tensor([[0, 1]], device=device)
    assert mgr.fetch_direct(layer, idx) is not None
    got = mgr.take_direct_usage()
    assert reads == [1] and mgr.table.grid.counter(got) == Counter({ExpertKey(layer, 0): 1, ExpertKey(layer, 1): 1})
    assert mgr.take_direct_usage() is None and reads == [1], "taken already: nothing new to read"
    mgr.end_decode()
    mgr.close()


def test_direct_reads_config_key():
    from tiers.config import parse_config

    assert parse_config(None).cpu.direct_reads is True
    assert parse_config({"tiers": {"cpu": {"direct_reads": False}}}).cpu.direct_reads is False
    with pytest.raises(ValueError, match="tiers.cpu.direct_reads"):
        parse_config({"tiers": {"cpu": {"direct_reads": "yes"}}})


# -- direct stacks: the staging path's small misses, read in place ------------------------------
def test_direct_stacks_serve_the_decoded_blob(device, packed_factory):
    """Random layer calls staged through direct stacks (forced on the CPU, the default on CUDA):
    every slot holds exactly its blob dequantized alone, and no copy into a transit row is made."""
    from test_integrity import decoded

    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 6}, "cpu": {"fraction": 0.25, "precision": "int8"}, "nvme": {"precision": "int8"}}}
    packed = packed_factory("qwen3_moe")
    mgr = manager_of(tiers.load(packed, cfg, device=device, progress=False))
    if device.type == "cpu":
        mgr.direct_reads = True
    assert mgr.direct_reads
    copies = []
    mgr._stage_copy = lambda *a: copies.append(a)
    import random

    rng = random.Random(0)
    layers = [L for L in mgr.manifest.layers if L not in mgr.static_maps]
    checked = 0
    for _ in range(30):
        layer = rng.choice(layers)
        held = mgr.acquire_layer(layer, sorted(rng.sample(range(8), rng.randint(2, 6))))
        mgr.wait_all(held)
        for h in held:
            if not mgr.table[h.key].pinned:
                want = decoded(packed, h.key, mgr._precision_of(mgr.table[h.key]), device)
                for name, t in h.tensors.items():
                    assert torch.equal(t, want[name]), f"{h.key} {name}"
                checked += 1
        mgr.release_all(held)
    assert checked > 30 and not copies
    assert mgr.stats().direct["stacks"] > 0
    assert all(r == 0 for p in mgr.pools for r in p.readers)


def test_a_direct_stack_reads_after_the_slots_last_reads_and_before_its_ready_event(packed_factory):
    """Recording streams: a direct stack's launch (a use of the copy stream) comes after the copy
    stream waited on the last read of every slot it rewrites; its slots' ready event is recorded on
    the copy stream after the launch; stacks hold at most STACK_EXPERTS experts."""
    from test_engine import _recorded_manager

    mgr, rec, _ = _recorded_manager(packed_factory("qwen3_moe"), staging=4)
    mgr.direct_reads = True
    pool = mgr.pools[0]
    stacks = []
    fetch = mgr.fetch_stack

    def spy(pool_, blob, starts, slots):
        rec.order.append(("fetch", None, tuple(slots)))
        ready = fetch(pool_, blob, starts, slots)
        stacks.append((tuple(slots), ready))
        return ready

    mgr.fetch_stack = spy
    layers = [L for L in mgr.manifest.layers if L not in mgr.static_maps]
    checked = 0
    for round_ in range(12):
        layer = layers[round_ % len(layers)]
        misses = [e for e in range(8) if not mgr.table[ExpertKey(layer, e)].pinned][:4]
        last_reads = {s: pool.last_read[s] for s in range(pool.n_slots)}
        start = len(rec.order)
        held = mgr.acquire_layer(layer, misses)
        assert held is not None
        order = rec.order[start:]
        for slots, ready in stacks:
            at = next((i for i, o in enumerate(order) if o[0] == "fetch" and o[2] == slots), None)
            if at is None:
                continue
            assert len(slots) <= mgr.STACK_EXPERTS
            for s in slots:
                ev = last_reads[s]
                if ev is not None:
                    assert any(o[0] == "wait" and o[1] is mgr.copy_stream and o[2] is ev for o in order[:at]), f"slot {s}"
                    checked += 1
            rec_at = next(i for i, o in enumerate(order) if o[0] == "record" and o[2] is ready)
            assert order[rec_at][1] is mgr.copy_stream and rec_at > at
            for h in held:
                if h.slot in slots:
                    assert pool.ready[h.slot] is ready
        stacks.clear()
        mgr.wait_all(held)
        mgr.release_all(held)
    assert checked > 10


# -- property test: slot ownership while decode stages come and go -----------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(st.tuples(st.sampled_from(["begin", "end", "direct", "acquire", "prefetch"]),
                          st.integers(0, 2), st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True)),
                min_size=1, max_size=30)


@pytest.fixture(scope="module")
def direct_manager(packed_factory):
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "int8"},
                     "nvme": {"precision": "int8"}}}
    packed = packed_factory("qwen3_moe")
    mgr = manager_of(tiers.load(packed, cfg, device="cpu", progress=False))
    mgr.direct_decode = mgr.direct_reads = True  # the torch reference on the CPU
    return mgr, packed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_decode_stages_keep_slot_ownership(direct_manager, ops):
    """Random decode stages, direct calls, host-routed calls and prefetches: while a stage runs its
    reserved slots are held once, empty of owners, never handed to the host-routed path or the
    prefetcher; each direct call leaves every pick that is not hot in a reserved slot holding
    exactly its decoded blob (distinct picks in distinct slots) and every hot pick pointing at its
    hot slot; after a stage nothing is held."""
    from test_integrity import decoded

    mgr, packed = direct_manager
    for op, layer, experts in ops:
        if op == "begin":
            mgr.begin_decode()
        elif op == "end":
            mgr.end_decode()
        elif op == "direct":
            if not mgr.direct_ready(layer, len(experts)):
                assert not mgr._reserved
                continue
            idx = torch.tensor([experts])
            ids = mgr.fetch_direct(layer, idx)[0].tolist()
            reserved = mgr._reserved[id(mgr.pool_of[layer])].slots
            pool = mgr.pool_of[layer]
            assert len(set(ids)) == len(ids), "two picks of a call share a slot"
            for e, slot in zip(experts, ids):
                r = mgr.table[ExpertKey(layer, e)]
                if r.pinned:
                    assert slot == r.slot
                else:
                    assert slot in reserved
                    want = decoded(packed, ExpertKey(layer, e), "int8")
                    assert all(torch.equal(pool.tensors(slot)[n], want[n]) for n in want)
            # the slot cache: one expert per lane, each non-hot pick's lane naming its cell
            cache = mgr._reserved[id(pool)].cache
            owners = [c for c in cache.owner.tolist() if c >= 0]
            assert len(owners) == len(set(owners)), "an expert in two reserved slots"
            row = mgr.table.grid.row[layer] * cache.width
            for e, slot in zip(experts, ids):
                if not mgr.table[ExpertKey(layer, e)].pinned:
                    assert cache.owner[cache.slots.tolist().index(slot)] == row + e
        elif op == "acquire":
            held = mgr.acquire_layer(layer, sorted(experts))
            if held is not None:
                reserved = {(id(p), s) for pid, r in mgr._reserved.items() for p in mgr.pools if id(p) == pid for s in r.slots}
                assert not any((id(h.pool), h.slot) in reserved for h in held), "a host-routed call got a reserved slot"
                mgr.wait_all(held)
                mgr.release_all(held)
        else:
            mgr.prefetch(layer, experts)
        for pool in mgr.pools:
            r = mgr._reserved.get(id(pool))
            for s in (r.slots if r else []):
                assert pool.readers[s] == 1 and pool.owner[s] is None
    mgr.end_decode()
    mgr.drain()
    assert all(n == 0 for p in mgr.pools for n in p.readers)
