"""Mixed pools: each expert is served in its own encoding wherever pack kept it at int8 (``--min-sqnr``).

With a pack whose int4 keeps about half the experts at int8, every tier (bf16 hot slots, int4
quantized hot in the GPU's blob pool, int4 warm, int4 cold) must give logits bit-identical
(torch.equal) to transformers' model whose experts are set by hand: a bf16 hot expert's source
weights, and every other expert decoded from a pack without ``--min-sqnr`` at int8 where its
recorded int4 SQNR is below the threshold, else at int4. Pools are sized at each blob's real
size; direct decode takes only layers whose experts it would read share one encoding.
"""
from __future__ import annotations

import importlib
import json
import shutil

import pytest
import torch

import tiers
from blob_files import decoded
from conftest import save_tiny
from tiers.api import manager_of
from tiers.loader.layout import ExpertKey, find_experts_modules
from tiers.loader.manifest_parse import checksum
from tiers.loader.pack import pack
from tiers.loader.packed import MANIFEST, read_manifest
from tiers.store.table import Home
from untiered import GEN, assert_bit_identical, assert_consistent, assert_generate_equal, prompt, reference

PRECISIONS = ("bf16", "int8", "int4")
inspect_cli = importlib.import_module("tiers.tools.inspect")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(source, a pack without min_sqnr, the mixed pack, the experts it keeps at int8)."""
    d = tmp_path_factory.mktemp("mixed")
    src = save_tiny("qwen3_moe", d / "hf", moe_intermediate_size=192)  # experts of 74 KB at bf16
    plain, mixed = d / "plain", d / "mixed"
    pack(src, plain, precisions=PRECISIONS, progress=False)
    m = read_manifest(plain)
    sqnr = sorted(m.ref(k, "int4").sqnr_db for k in m.keys)
    thr = sqnr[len(sqnr) // 2]
    pack(src, mixed, precisions=PRECISIONS, progress=False, min_sqnr=thr)
    kept = {k for k in m.keys if m.ref(k, "int4").sqnr_db < thr}
    assert 0 < len(kept) < len(m.keys)
    return src, plain, mixed, kept


def _by_hand(made, mgr, kept=None):
    """transformers' model of the source with each expert as ``mgr`` should serve it (see the module
    docstring); ``kept``: the experts at int8, where not the mixed pack's."""
    src, plain, _, kept = *made[:3], made[3] if kept is None else kept
    ref = reference(src, "cpu", batched_decode=mgr.batched_decode)
    modules = find_experts_modules(ref)
    for key, r in mgr.table.items():
        if r.hot and mgr.gpu_pool is None:
            continue  # a bf16 slot: the source's weights
        want = decoded(plain, key, "int8" if key in kept else "int4")
        for name, w in want.items():
            getattr(modules[key.layer][1], name).data[key.expert].copy_(w)
    return ref


def _cfg(gpu: dict, cpu_fraction: float) -> dict:
    return {"tiers": {"gpu": gpu, "cpu": {"fraction": cpu_fraction, "precision": "int4"}, "nvme": {"precision": "int4"}}}


CONFIGS = {
    "bf16 hot, int4 warm and cold": _cfg({"fraction": 0.25}, 0.3),
    "int4 quantized hot, warm and cold": _cfg({"budget": 800_000, "precision": "int4", "staging_slots": 4}, 0.2),
    "int4 quantized hot and warm": _cfg({"budget": 800_000, "precision": "int4", "staging_slots": 4}, 0.9),
    "every expert int4 warm": _cfg({"budget": 500_000, "staging_slots": 4}, 1.0),  # the staging slots take it whole
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_tier_serves_each_expert_in_its_own_encoding(made, name):
    model = tiers.load(made[2], CONFIGS[name], device="cpu", progress=False)
    mgr = manager_of(model)
    homes = {h: {k for k, r in mgr.table.items() if r.home is h and not (r.hot and mgr.gpu_pool is None)} for h in Home}
    for h, keys in homes.items():  # the tiers that hold int4 experts hold some kept at int8 and some not
        assert not keys or (keys & made[3] and keys - made[3]), (name, h)
    assert_bit_identical(_by_hand(made, mgr), model, prompt("cpu"))
    s = tiers.stats(model).as_dict()
    for h, keys in homes.items():
        assert not keys or s["hits"][h.value] > 0, f"{name}: the {h.value} tier served none of its experts: {s['hits']}"
    assert_consistent(mgr)


def test_every_tier_equals_every_expert_warm(made):
    ids = prompt("cpu")
    every = tiers.load(made[2], CONFIGS["every expert int4 warm"], progress=False)
    assert not manager_of(every).placement.cold and not manager_of(every).placement.hot
    tiered = tiers.load(made[2], CONFIGS["int4 quantized hot, warm and cold"], progress=False)
    with torch.no_grad():
        assert torch.equal(every(ids).logits, tiered(ids).logits)
    assert_generate_equal(every.generate(ids, **GEN), tiered.generate(ids, **GEN))


def test_pools_hold_each_blob_at_its_real_size(made):
    model = tiers.load(made[2], CONFIGS["int4 quantized hot, warm and cold"], progress=False)
    mgr, kept = manager_of(model), made[3]
    m, p = mgr.manifest, mgr.placement
    int4, int8 = m.layers[0].blobs["int4"].stride, m.layers[0].blobs["int8"].stride
    assert int4 < int8
    stride = {k: int8 if k in kept else int4 for k in m.keys}
    assert p.gpu_pool_bytes == sum(stride[k] for k in p.gpu_pool) == mgr.gpu_pool.capacity
    assert mgr.host.parts["warm"] == sum(stride[k] for k in p.warm)
    assert all(g.transit_bytes == int8 for g in p.groups)  # a transit row holds the largest blob staged
    assert p.gpu_bytes <= p.gpu_budget
    doc = tiers.manifest(model)
    for e in doc["experts"]:
        key = ExpertKey(e["layer"], e["expert"])
        assert e["precision"] == "int4" and e["encoding"] == ("int8" if key in kept else "int4")
        assert e["bytes"] == stride[key]
    text = inspect_cli.runtime_table(doc)  # tiers-inspect manifest.json
    for tier, line, keys in zip(("gpu", "cpu", "nvme"), doc["summary"], (p.gpu_pool, p.warm, p.cold)):
        n = len(set(keys) & kept)
        assert (f"{n} kept at int8" in line) == (n > 0), line
        assert f"{tier}: {len(keys)} experts, " in text and (f"(int4, {n} kept at int8)" in text) == (n > 0), text


@pytest.mark.parametrize("name", ["every expert int4 warm", "int4 quantized hot and warm"])
def test_direct_decode_takes_only_layers_of_one_encoding(made, name):
    """Direct decode forced on the CPU (the torch reference standing in for its kernel): a layer
    runs direct only where the experts it would decode share one encoding; the logits are those
    of the experts set by hand either way."""
    ids = prompt("cpu", batch=1)
    for root, mixed in ((made[1], False), (made[2], True)):
        model = tiers.load(root, CONFIGS[name], progress=False)
        mgr = manager_of(model)
        mgr.batched_decode = True
        mgr.staging.direct_reads = mgr.direct.enabled = True
        out = model.generate(ids, **GEN)
        assert mgr.direct.agrees()
        assert not mgr.placement.cold
        qualify = set()
        for L, entry in mgr.manifest.layers.items():
            read = [e for e in range(entry.layout.num_experts) if not mgr.table[ExpertKey(L, e)].hot]
            if len({mgr.manifest.blob(ExpertKey(L, e), "int4").precision for e in read}) == 1:
                qualify.add(L)
        assert set(mgr.direct.layers or {}) == qualify and (qualify != set(mgr.manifest.layers)) == mixed, root
        assert (tiers.stats(model).direct["decode_calls"] > 0) == bool(qualify)
        if mixed:
            assert_generate_equal(_by_hand(made, mgr).generate(ids, **GEN), out)


def test_the_rebalancer_with_a_mixed_warm_pool_is_refused(made):
    cfg = _cfg({"fraction": 0.25}, 0.3)
    cfg["tiers"]["rebalance"] = {"every_tokens": 8}
    with pytest.raises(ValueError, match=r"tiers\.rebalance\.every_tokens: .* layer \d+ of .* holds its int4 experts in two "
                                         r"encodings \(int4, int8: pack --min-sqnr\)"):
        tiers.load(made[2], cfg, progress=False)
    tiers.load(made[1], cfg, progress=False)  # the same without --min-sqnr loads


def test_a_transit_row_holds_the_largest_blob_of_any_layer_of_its_pool(made, tmp_path):
    """Layers of one expert shape share a slot pool and its transit rows; here only the last layer
    keeps experts at int8 (its int4 references aliased by hand, as pack writes them)."""
    root = tmp_path / "last"
    shutil.copytree(made[1], root)
    doc = json.loads((root / MANIFEST).read_text())
    last = doc["layers"][-1]
    for x in last["experts"][::2]:
        x["int4"] = {**x["int8"], "encoding": "int8"}
    doc["checksum"] = checksum(doc)
    (root / MANIFEST).write_text(json.dumps(doc))
    kept = {ExpertKey(last["layer"], x["expert"]) for x in last["experts"][::2]}
    every = {"tiers": {"gpu": {"fraction": 1.0, "precision": "int4"}, "cpu": {"precision": "int4"}, "nvme": {"precision": "int4"}}}
    for cfg in (every, CONFIGS["every expert int4 warm"]):
        model = tiers.load(root, cfg, progress=False)
        mgr = manager_of(model)
        assert [g.transit_bytes for g in mgr.placement.groups] == [mgr.manifest.layers[0].blobs["int8"].stride]
        assert_bit_identical(_by_hand(made, mgr, kept), model, prompt("cpu", batch=4, length=16))
