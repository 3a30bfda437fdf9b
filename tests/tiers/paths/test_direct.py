"""Direct decode (tiers.paths.direct): in generate's decode stage, qualifying layers read their
misses from the pinned pool on the device (quant.direct), with no host sync and no staging.

On CUDA the path is on by default; on the CPU the tests switch the decode switch and the path on
(``batched_decode``, ``staging.direct_reads``, ``direct.enabled``), so the same logic runs through
the torch reference kernel. Against an untiered model whose decode stage runs batched_mm (as
transformers' does on a GPU), bf16 tiers give bit-identical logits on both devices.

The direct stacks of the host-routed path are in tests/tiers/paths/test_direct_stacks.py, and the
slot ownership of decode stages coming and going in tests/tiers/paths/test_direct_ownership.py.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import tiers
from blob_files import decoded
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey, find_experts_modules
from tiers.paths import direct as direct_mod
from tiers.paths.direct import DirectPath
from tiers.store.table import Home
from tiers.transfer import staging as staging_mod
from untiered import GEN, assert_consistent, assert_generate_equal, prompt, reference

# a few experts hot per layer, every other one warm in bf16; 8 staging slots, all reserved for direct misses
# (every layer qualifies)
DIRECT_BF16 = {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}


def _load(packed, tiers_: dict, device, *, direct: bool = True):
    """Graphs off: these tests spy on the direct calls one by one (tests/tiers/graphs/ checks the
    same calls inside decode and step graphs against them)."""
    cfg = {"tiers": tiers_ | {"gpu": tiers_.get("gpu", {}) | {"graphs": False}}}
    model = tiers.load(packed, cfg, device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True  # what a GPU does; forced on the CPU
    if device.type == "cpu" and direct:
        mgr.staging.direct_reads = True  # the torch reference stands in for the kernel
    assert not direct or mgr.staging.direct_reads, "direct reads: on a GPU with Triton and a pinned pool"
    mgr.direct.enabled = direct  # on by default there
    return model, mgr


def _ref(checkpoint_factory, model_type: str, device):
    return reference(checkpoint_factory(model_type), device, batched_decode=True)


def _count_direct(monkeypatch, mgr) -> list[tuple[int, list[int]]]:
    """Spy on the direct path's calls: (layer, picks) each."""
    calls = []
    run = mgr.direct.run

    def spy(module, layer, hidden_states, top_k_index, top_k_weights):
        calls.append((layer, top_k_index.reshape(-1).tolist()))
        return run(module, layer, hidden_states, top_k_index, top_k_weights)

    monkeypatch.setattr(mgr.direct, "run", spy)
    return calls


def _check_misses(monkeypatch, mgr, packed, precision: str, device) -> list[int]:
    """Spy on direct fetches: after each, every pick not hot must sit in a reserved slot holding
    exactly its blob in ``precision``, decoded alone; returns the list of the checked misses."""
    checked: list[int] = []
    fetch = mgr.direct._fetch

    def check(d, layer, top_k_index, counts):
        ids = fetch(d, layer, top_k_index, counts)
        pool = mgr.pool_of[layer]
        reserved = mgr.table.reserved_slots(pool.index, "direct")
        for e, slot in zip(top_k_index.reshape(-1).tolist(), ids.reshape(-1).tolist()):
            if not mgr.table[ExpertKey(layer, e)].hot:
                assert slot in reserved
                want = decoded(packed, ExpertKey(layer, e), precision, device)
                for name, t in pool.tensors(slot).items():
                    assert torch.equal(t, want[name]), f"layer {layer} expert {e} {name}"
                checked.append(e)
        return ids

    monkeypatch.setattr(mgr.direct, "_fetch", check)
    return checked


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_direct_decode_matches_untiered_decode(model_type, device, checkpoint_factory, packed_factory, monkeypatch):
    ref = _ref(checkpoint_factory, model_type, device)
    model, mgr = _load(packed_factory(model_type), DIRECT_BF16, device)
    calls = _count_direct(monkeypatch, mgr)
    layers = len(mgr.manifest.layers)
    ids = prompt(device)  # 2 sequences x top-2: 4 picks per call, half the reserved slots
    a = ref.generate(ids, **GEN)
    mgr.reset_stats()
    b = model.generate(ids, **GEN)
    steps = GEN["max_new_tokens"] - 1
    assert len(calls) == layers * steps, "every decode step of every layer must run direct"
    assert_generate_equal(a, b)
    s = tiers.stats(model)
    assert s.direct["decode_calls"] == layers * steps and s.direct["on"] == 1
    assert "direct reads: %d decode layer calls" % (layers * steps) in str(s) and s.as_dict()["direct"] == s.direct
    lookups = sum(s.hits.values())
    prefill_lookups = lookups - layers * steps * 4
    assert s.hits["cpu"] > 0 and prefill_lookups > 0
    blob = mgr.manifest.layers[0].blobs["bf16"].nbytes
    assert s.bytes_moved["cpu"] == blob * s.hits["cpu"], "every cpu hit moves one blob"
    assert s.misses["gpu"] == s.hits["cpu"] + s.hits["nvme"]
    # the reserved slots are given back, empty, with nobody holding them
    assert not mgr.direct.reserved and not mgr.phase.decoding
    assert_consistent(mgr)
    assert mgr.direct.agrees()
    # ... and the host-routed path works after the decode stage: a second generate matches too
    assert_generate_equal(a, model.generate(ids, **GEN))


def _cache_model(calls, lanes: int, rows: int, row_of, hot) -> tuple[int, int, int]:
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
            if hot(layer, e):
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


def test_direct_counts_resident_decoded_and_cached_picks(device, packed_factory, monkeypatch):
    """Each direct call's picks: resident (hot) ones and those the reserved slots still hold count
    as gpu hits, the others as cpu hits that moved one blob each; checked against the routing the
    calls saw, through a model of the slot cache written in the test."""
    model, mgr = _load(packed_factory("mixtral"), DIRECT_BF16, device)
    seen = _count_direct(monkeypatch, mgr)
    model.generate(prompt(device), **GEN)
    mgr.reset_stats()
    seen.clear()
    lanes = set()
    begin = mgr.direct.begin_stage

    def spy_begin():
        begin()
        lanes.update(len(mgr.table.reserved_slots(p, "direct")) for p in mgr.direct.reserved)
    monkeypatch.setattr(mgr.direct, "begin_stage", spy_begin)
    model.generate(prompt(device, batch=1), **GEN)
    d_gpu, d_cpu, d_bytes, _ = mgr.direct.served()
    grid = mgr.table.grid
    (lane_count,) = lanes
    assert lane_count == 8, "every layer runs direct: all 8 staging slots are reserved"
    hot, decoded_, cached = _cache_model(seen, lane_count, len(grid.layers), grid.row, lambda L, e: mgr.table[ExpertKey(L, e)].hot)
    assert cached > 0, "the reserved slots kept nothing across steps"
    assert (d_gpu, d_cpu) == (hot + cached, decoded_)
    assert d_bytes == d_cpu * mgr.manifest.layers[0].blobs["bf16"].nbytes


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_direct_int8_misses_hold_the_decoded_blob(model_type, device, packed_factory, monkeypatch):
    """INT8 warm tier: after a direct call, each missed pick's slot holds exactly what the scheme
    decodes from the expert's blob (GPT-OSS: weights scaled per column and exact biases, two
    encodings in one expert: on CUDA one kernel launch per encoding)."""
    cfg = {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "int8"}, "nvme": {"precision": "int8"}}
    packed = packed_factory(model_type)
    model, mgr = _load(packed, cfg, device)
    checked = _check_misses(monkeypatch, mgr, packed, "int8", device)
    model.generate(prompt(device, batch=1), **GEN)
    assert checked, "no miss was read directly"
    assert tiers.stats(model).direct["decode_calls"] == len(mgr.manifest.layers) * (GEN["max_new_tokens"] - 1)


@pytest.mark.parametrize("case", ["cold", "recording", "off", "too_many_picks"])
def test_direct_decode_falls_back_to_host_routing(case, device, checkpoint_factory, packed_factory, monkeypatch):
    """Layers that cannot run direct keep the host-routed path, still bit-identical to the untiered
    model: some expert of every layer on disk, a routing trace recorded (no slots are reserved),
    the path off, or more picks per call than reserved slots (the first such call gives them back)."""
    cfg = {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"}, "nvme": {"precision": "bf16"}}
    batch = 2
    if case == "cold":
        cfg["cpu"] = {"fraction": 0.2, "precision": "bf16"}  # some experts of every layer on disk
    if case == "too_many_picks":
        batch = 5  # 10 picks per call, 8 reserved slots
    ref = _ref(checkpoint_factory, "mixtral", device)
    model, mgr = _load(packed_factory("mixtral"), cfg, device, direct=case != "off")
    if case == "cold":
        assert all(any(mgr.table[ExpertKey(L, e)].home is Home.NVME for e in range(8)) for L in mgr.manifest.layers)
    if case == "recording":
        mgr.slots.recorded = []
    calls = _count_direct(monkeypatch, mgr)
    begun = []
    begin = mgr.direct.begin_stage
    monkeypatch.setattr(mgr.direct, "begin_stage", lambda: begin() or begun.append(sorted(mgr.direct.reserved)))
    ids = prompt(device, batch=batch)
    a, b = ref.generate(ids, **GEN), model.generate(ids, **GEN)
    assert calls == []
    assert begun == [[0] if case == "too_many_picks" else []], "slots are reserved only where a layer could run direct"
    assert not mgr.direct.reserved
    if case == "recording":
        assert mgr.slots.recorded, "the host-routed calls recorded their lookups"
        mgr.slots.recorded = None
    assert_consistent(mgr)
    assert_generate_equal(a, b)


@pytest.mark.parametrize("large", [True, False])
def test_decode_stages_choose_their_path_by_the_last_stages_miss_bytes(large, device, checkpoint_factory, packed_factory, monkeypatch):
    """Experts the host-routed path would copy (above ``STACK_BYTES``): a stage whose layer calls
    missed ``MISS_BYTES`` or more on average sends the next stage host-routed, and one that
    missed less sends it back direct; the mean is the stage's miss bytes over its decode layer
    calls, whichever path served them. Small experts (direct stacks) stay direct. Every stage
    matches the untiered model."""
    if large:
        monkeypatch.setattr(direct_mod, "STACK_BYTES", 1024)
        monkeypatch.setattr(staging_mod, "STACK_BYTES", 1024)
    monkeypatch.setattr(DirectPath, "MISS_BYTES", 1)  # any miss: host-routed next
    ref = _ref(checkpoint_factory, "mixtral", device)
    model, mgr = _load(packed_factory("mixtral"), DIRECT_BF16, device)
    calls = _count_direct(monkeypatch, mgr)
    reads, begun = [], []
    count, count_call = mgr.staging._count, mgr.count_call
    monkeypatch.setattr(mgr.staging, "_count", lambda pool, source, n, t0: reads.append((mgr.phase.decoding, n)) or count(pool, source, n, t0))
    monkeypatch.setattr(mgr, "count_call", lambda *a, **k: begun.append(mgr.phase.decoding) or count_call(*a, **k))
    (pid,) = {p.index for p in mgr.pools}
    layers, steps = len(mgr.manifest.layers), GEN["max_new_tokens"] - 1
    ids = prompt(device, batch=1)
    a = ref.generate(ids, **GEN)
    reserved = []
    begin = mgr.direct.begin_stage
    monkeypatch.setattr(mgr.direct, "begin_stage", lambda: begin() or reserved.append(pid in mgr.direct.reserved))

    def generate():
        calls.clear(), reads.clear(), begun.clear(), reserved.clear()
        mgr.reset_stats()
        assert_generate_equal(a, model.generate(ids, **GEN))

    generate()  # the first stage runs direct
    assert len(calls) == layers * steps and not any(begun) and reserved == [True]
    _, _, moved, _ = mgr.direct.served()
    assert moved > 0 and mgr.direct.miss_bytes_per_call[pid] == moved / (layers * steps)
    generate()
    if not large:  # read by direct stacks either way: direct stays
        assert len(calls) == layers * steps and reserved == [True]
        return
    assert calls == [] and reserved == [False]
    decode_bytes = sum(n for decoding, n in reads if decoding)
    assert sum(begun) == layers * steps and decode_bytes > 0
    assert mgr.direct.miss_bytes_per_call[pid] == decode_bytes / (layers * steps)
    monkeypatch.setattr(DirectPath, "MISS_BYTES", decode_bytes)  # the last stage's mean is below it: direct again
    generate()
    assert len(calls) == layers * steps and reserved == [True]


@pytest.mark.parametrize("precision", ["int4", "nf4", "int8"])
def test_four_bit_pools_decode_direct_whatever_they_miss(precision, device, packed_factory, monkeypatch):
    """Experts above ``STACK_BYTES`` whose first stage missed ``MISS_BYTES`` or more per call: an
    INT8 pool's next stage goes host-routed, a 4-bit pool's stays direct (its SMs' reads beat
    the copy engine's copies and decode, ``DirectPath``)."""
    if precision == "nf4":
        pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(direct_mod, "STACK_BYTES", 1024)
    monkeypatch.setattr(staging_mod, "STACK_BYTES", 1024)
    monkeypatch.setattr(DirectPath, "MISS_BYTES", 1)  # any miss: an INT8 pool's next stage is host-routed
    cfg = {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": precision}, "nvme": {"precision": precision}}
    model, mgr = _load(packed_factory("mixtral", ("bf16", precision)), cfg, device)
    calls = _count_direct(monkeypatch, mgr)
    ids, steps = prompt(device, batch=1), len(mgr.manifest.layers) * (GEN["max_new_tokens"] - 1)
    first = model.generate(ids, **GEN)
    assert len(calls) == steps and mgr.direct.served()[2] > 0, "the first stage runs direct and misses"
    calls.clear()
    assert_generate_equal(first, model.generate(ids, **GEN))
    assert len(calls) == (0 if precision == "int8" else steps)


def test_large_experts_decode_direct_exactly_without_stacks(device, checkpoint_factory, packed_factory, monkeypatch):
    """Experts above ``STACK_BYTES`` (as Mixtral-8x7B's in the bench) decode direct in a first
    stage, each miss's slot holding exactly its blob, and the logits equal the untiered model's;
    the staging path copies them (no direct stack), as it does large experts."""
    monkeypatch.setattr(direct_mod, "STACK_BYTES", 1024)
    monkeypatch.setattr(staging_mod, "STACK_BYTES", 1024)
    ref = _ref(checkpoint_factory, "mixtral", device)
    packed = packed_factory("mixtral")
    model, mgr = _load(packed, DIRECT_BF16, device)
    assert mgr.manifest.layers[0].blobs["bf16"].nbytes > 1024
    misses, stacked = _check_misses(monkeypatch, mgr, packed, "bf16", device), []
    fetch_stack = mgr.staging._fetch_stack
    monkeypatch.setattr(mgr.staging, "_fetch_stack", lambda *a: stacked.append(a) or fetch_stack(*a))
    ids = prompt(device)
    a, b = ref.generate(ids, **GEN), model.generate(ids, **GEN)
    assert misses, "no miss was read directly"
    assert stacked == [] and tiers.stats(model).direct["stacks"] == 0
    assert_generate_equal(a, b)


def test_direct_decode_with_the_rebalancer(device, checkpoint_factory, packed_factory, monkeypatch):
    """The rebalancer on: direct calls count their picks on the device, the rebalancer takes the
    counts once per interval (exactly the picks of the direct calls since the last take), swaps
    land between forwards and the device tables follow them; the logits still equal the untiered
    model's (bf16 tiers). A rebuild with nothing moved keeps every layer's tables; a move
    rewrites them in place (the decode graphs keep their addresses)."""
    ref = _ref(checkpoint_factory, "qwen3_moe", device)
    cfg = DIRECT_BF16 | {"rebalance": {"every_tokens": 4, "window": 4}}  # intervals long enough for a swap to be significant
    model, mgr = _load(packed_factory("qwen3_moe"), cfg, device)
    picks: Counter = Counter()
    taken: Counter = Counter()
    calls = _count_direct(monkeypatch, mgr)
    take = mgr.direct.take_usage

    def spy_take():
        got = take()
        if got is not None:
            taken.update(mgr.table.grid.counter(got))
        return got

    monkeypatch.setattr(mgr.direct, "take_usage", spy_take)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    kw = GEN | {"max_new_tokens": 24, "min_new_tokens": 24}
    a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert_generate_equal(a, b)
    picks.update(ExpertKey(layer, e) for layer, experts in calls for e in experts)
    s = tiers.stats(model)
    assert s.rebalance["promoted_hot"] > 0 and sum(picks.values()) > 0
    assert sum(taken.values()) > 0, "the rebalancer must take the device counts when an interval closes"
    assert taken + mgr.table.grid.counter(take()) == picks, "the device counts must be exactly the direct calls' picks"
    # the device tables follow the table after the swaps
    mgr.begin_decode()
    d = mgr.direct
    assert d.version == mgr.table.homes_version and d.agrees()
    for layer, t in d.layers.items():
        for e, (slot, start) in enumerate(zip(t.resident.tolist(), t.starts.tolist())):
            r = mgr.table[ExpertKey(layer, e)]
            assert slot == (r.slot if r.hot else -1) and (r.hot or start == r.host_offset)
    built, uploads, upload = dict(d.layers), [], d._upload
    monkeypatch.setattr(d, "_upload", lambda: uploads.append(1) or upload())
    assert all(d._build()[L] is t for L, t in built.items()) and not uploads
    layer = next(iter(built))
    x, y = [k for k in mgr.manifest.keys if k.layer == layer and mgr.table[k].home is Home.CPU][:2]
    places = mgr.table[x].host_offset, mgr.table[y].host_offset
    mgr.table.move(x, places[1])  # the two trade places (in the table only: nothing decodes after)
    mgr.table.move(y, places[0])
    starts = built[layer].starts.data_ptr()
    rebuilt = d._build()[layer]
    assert rebuilt.starts.data_ptr() == starts and len(uploads) == 1
    assert rebuilt.starts[[x.expert, y.expert]].tolist() == [places[1], places[0]] and d.agrees()
    mgr.end_decode()
    mgr.close()


def test_the_rebalancer_reads_the_direct_counts_only_after_a_direct_call(device, packed_factory, monkeypatch):
    """The device's direct-decode counts are read (a sync) only when a direct call ran since the
    last take: an interval that only long prompts closed takes nothing and reads nothing."""
    cfg = DIRECT_BF16 | {"rebalance": {"every_tokens": 2}}
    model, mgr = _load(packed_factory("mixtral"), cfg, device)
    mgr.begin_decode()  # builds the direct tables
    assert mgr.direct.layers
    reads = []
    usage = mgr.direct.usage

    class Spy:
        def reshape(self, *a):
            reads.append(1)
            return usage.reshape(*a)

        def zero_(self):
            return usage.zero_()
    monkeypatch.setattr(mgr.direct, "usage", Spy())
    assert mgr.direct.take_usage() is None and not reads, "nothing ran: nothing to read"
    layer = next(iter(mgr.direct.layers))
    module = find_experts_modules(model)[layer][1]
    h = torch.randn(1, module.hidden_dim, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    with torch.no_grad():
        mgr.direct.run(module, layer, h, torch.tensor([[0, 1]], device=device), torch.full((1, 2), 0.5, dtype=torch.bfloat16, device=device))
    got = mgr.direct.take_usage()
    assert reads == [1] and mgr.table.grid.counter(got) == Counter({ExpertKey(layer, 0): 1, ExpertKey(layer, 1): 1})
    assert mgr.direct.take_usage() is None and reads == [1], "taken already: nothing new to read"
    mgr.end_decode()
    mgr.close()
