"""Quantized hot experts: with ``tiers.gpu.precision`` not bf16, hot experts stay in their packed
form on the GPU (``tiers.store.pools.BlobPool``), counted at their real size, and a call that uses
one dequantizes it into a staging slot from device memory, moving no bytes between tiers.

Bounds: exact. The same blobs decode to the same slots whichever tier they come from, so every
tier in one precision gives logits bit-identical to every expert quantized hot
(``tests/tiers/test_tiered_precisions.py`` compares those for prefill and decode).
"""
from __future__ import annotations

import pytest
import torch

import tiers
from tiers.api import manager_of
from tiers.loader.pack import pack

from conftest import devices, save_tiny


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("qhot")
    src = save_tiny("qwen3_moe", d / "hf", moe_intermediate_size=192)  # experts of 74 KB at bf16: 4 KiB alignment small beside them
    pack(src, d / "packed", precisions=("bf16", "int8", "int4"), progress=False)
    return d / "packed"


def _cfg(precision: str, budget: int) -> dict:
    return {"tiers": {"gpu": {"budget": budget, "precision": precision, "staging_slots": 4},
                      "cpu": {"fraction": 0.2, "precision": "int4"}, "nvme": {"precision": "int4"}}}


def test_the_budget_holds_the_blobs_at_their_real_size(packed):
    """At one budget, int4 holds several times as many hot experts as bf16 (each is a blob of
    4 + 12/32 + 32/C bits a weight for rows of C inputs, 4 KiB aligned, against a bf16 slot); what
    the budget bought fits it."""
    budget = 700_000  # 4 staging slots and their transit rows take 377 KB of it
    bf16 = manager_of(tiers.load(packed, _cfg("bf16", budget), progress=False))
    int4 = manager_of(tiers.load(packed, _cfg("int4", budget), progress=False))
    p = int4.placement
    assert p.gpu_pool and not p.hot and not bf16.placement.gpu_pool
    assert len(p.gpu_pool) >= 2.5 * len(bf16.placement.hot), (len(p.gpu_pool), len(bf16.placement.hot))
    strides = sum(int4.manifest.blob(k, "int4").stride for k in p.gpu_pool)
    assert p.gpu_pool_bytes == strides == int4.gpu_pool.capacity
    assert p.gpu_bytes <= budget  # the plan fits its budget


def test_the_runtime_manifest_and_stats_count_them_as_gpu_experts(packed):
    model = tiers.load(packed, _cfg("int4", 700_000), progress=False)
    mgr = manager_of(model)
    doc = tiers.manifest(model)
    hot = [e for e in doc["experts"] if e["tier"] == "gpu"]
    assert len(hot) == len(mgr.placement.gpu_pool) and all(e["precision"] == "int4" and not e["hot"] for e in hot)
    assert sum(e["bytes"] for e in hot) == mgr.placement.gpu_pool_bytes == doc["gpu"]["quantized_hot"]
    assert doc["gpu"]["total"] == doc["gpu"]["slots"] + doc["gpu"]["transit"] + doc["gpu"]["quantized_hot"] <= 700_000
    assert "hot in int4" in doc["summary"][0]
    s = tiers.stats(model)
    assert s.residency["gpu"] == {"experts": len(hot), "bytes": mgr.placement.gpu_pool_bytes}


def test_a_quantized_hot_expert_moves_no_bytes_and_counts_a_gpu_hit(packed):
    """Staging one from the blob pool copies device to device: its slot holds its decoded blob,
    and neither the bytes moved nor the misses grow; a warm one's do."""
    model = tiers.load(packed, _cfg("int4", 700_000), progress=False)
    mgr = manager_of(model)
    for key, pooled in ((mgr.placement.gpu_pool[0], True), (mgr.placement.warm[0], False)):
        moved, hits, misses = dict(mgr.stats_.bytes_moved), dict(mgr.stats_.hits), dict(mgr.stats_.misses)
        held = mgr.slots.acquire(key)
        mgr.slots.wait_all([held])
        want = {name: torch.empty_like(t) for name, t in held.pool.tensors(held.slot).items()}
        mgr.manifest.blob(key, "int4").dequantize_into(mgr.staging.fetch(key, mgr.table[key], held.pool, held.slot)[2], want)
        assert all(torch.equal(held.pool.tensors(held.slot)[n], want[n]) for n in want), key
        mgr.slots.release_all([held])
        assert (mgr.stats_.bytes_moved == moved) == pooled, key
        assert (mgr.stats_.misses == misses) == pooled and mgr.stats_.hits["gpu"] == hits["gpu"] + pooled, key


def test_generate_runs_and_equals_every_expert_in_the_blob_pool(packed):
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    every = tiers.load(packed, {"tiers": {"gpu": {"fraction": 1.0, "precision": "int4"}, "nvme": {"precision": "int4"},
                                          "cpu": {"precision": "int4"}}}, progress=False)
    assert len(manager_of(every).placement.gpu_pool) == len(manager_of(every).manifest.keys)
    mixed = tiers.load(packed, _cfg("int4", 700_000), progress=False)
    a, b = every.generate(ids, **kw), mixed.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    assert tiers.stats(every).bytes_moved == {"cpu": 0, "nvme": 0}


def test_the_rebalancer_with_quantized_hot_experts_is_refused(packed):
    cfg = _cfg("int4", 700_000)
    cfg["tiers"]["rebalance"] = {"every_tokens": 8}
    with pytest.raises(ValueError, match=r"tiers\.rebalance\.every_tokens: .* tiers\.gpu\.precision 'int4'"):
        tiers.load(packed, cfg, progress=False)


def test_direct_decode_reads_them_from_the_blob_pool(packed):
    """Decode with direct decode (forced on the CPU, the torch reference standing in for the
    kernel): the same logits as the host-routed path, its layers run direct, and with every
    expert quantized hot nothing moves between tiers."""
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    every = {"tiers": {"gpu": {"fraction": 1.0, "precision": "int4", "staging_slots": 8}, "cpu": {"precision": "int4"},
                       "nvme": {"precision": "int4"}}}
    out = {}
    for name, cfg in (("mixed", _cfg("int4", 1_000_000)), ("every", every)):
        for direct_on in (False, True):
            model = tiers.load(packed, cfg, progress=False)
            mgr = manager_of(model)
            mgr.batched_decode = True
            mgr.staging.direct_reads = mgr.direct.enabled = direct_on
            out[name, direct_on] = model.generate(ids, **kw), tiers.stats(model)
            assert mgr.direct.agrees()
        (a, _), (b, s) = out[name, False], out[name, True]
        assert torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), name
        assert s.direct["decode_calls"] > 0, name
    assert out["every", True][1].bytes_moved == {"cpu": 0, "nvme": 0} and out["every", True][1].misses["gpu"] == 0


@pytest.mark.parametrize("device", devices())
def test_fused_products_read_int4_hot_experts_in_place(packed, device, monkeypatch):
    """With every expert int4 hot, a decode call multiplies by the blobs in place (``quant.fused4``:
    the Triton kernel on CUDA, its torch reference on the CPU): the same tokens as through the
    slots, logits within a bf16 GEMM's rounding of them (the products' sums may run in another
    order; on the CPU, torch 2.13, they were equal), every pick a GPU hit, and no slot read."""
    from tiers.quant import fused4

    calls = []
    real = fused4.linear
    monkeypatch.setattr(fused4, "linear", lambda *a: calls.append(a[-1].rows) or real(*a))
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(0)).to(device)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    every = {"tiers": {"gpu": {"fraction": 1.0, "precision": "int4", "staging_slots": 8}, "cpu": {"precision": "int4"},
                       "nvme": {"precision": "int4"}}}
    out = {}
    for fused in (False, True):
        model = tiers.load(packed, every, device=device, progress=False)
        mgr = manager_of(model)
        mgr.batched_decode = True
        mgr.staging.direct_reads = mgr.direct.enabled = True
        mgr.direct.fused = fused
        for slab in mgr.pools[0].slabs.values():
            slab.fill_(float("nan"))  # a slot the fused path read would poison the logits
        out[fused] = model.generate(ids, **kw), tiers.stats(model)
        # reads from the blob pool are no misses: the next decode stage keeps reading direct
        # (counted as misses, Mixtral's 96 MB experts once made it skip the pool, and its step
        # graph recapture without the slot cache)
        assert mgr.direct.miss_bytes_per_call == {mgr.pools[0].index: 0.0}
    (a, _), (b, s) = out[False], out[True]
    layers = len(manager_of(model).manifest.layers)
    steps = 2 * layers * 5  # each of the 5 decode steps' layers: two fused products (on CUDA a step graph replays them)
    assert len(calls) == steps if device == "cpu" else 0 < len(calls) <= steps
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.isfinite(y).all() and (x - y).abs().max() <= 0.02 * x.abs().max(), (x - y).abs().max()
    assert s.bytes_moved == {"cpu": 0, "nvme": 0} and s.misses["gpu"] == 0 and s.direct["decode_calls"] == layers * 5


def test_auto_staging_leaves_room_for_every_quantized_expert(packed):
    """``staging_slots: auto`` with hot experts quantized: fewer slots where that is what lets every
    expert into the GPU's blob pool; where even one slot leaves no room, the slots auto takes anyway."""
    from tiers.policy.placement import _Sizes

    mgr = manager_of(tiers.load(packed, _cfg("int4", 10**9), progress=False))
    manifest = mgr.manifest
    every = sum(manifest.blob(k, "int4").stride for k in manifest.keys)
    for budget, slots, all_hot in ((None, 2, True), (every // 2, None, False)):
        cfg = _cfg("int4", 0)
        cfg["tiers"]["gpu"]["staging_slots"] = "auto"
        sizes = _Sizes(mgr.cfg, manifest)  # the reserve of n slots does not depend on the budget
        plain = sizes.auto_staging(10**12)  # what auto takes with room to spare
        assert plain > 2
        cfg["tiers"]["gpu"]["budget"] = budget if budget is not None else every + sizes.reserve(slots)
        p = manager_of(tiers.load(packed, cfg, progress=False)).placement
        assert [g.staging for g in p.groups] == [slots if all_hot else sizes.auto_staging(cfg["tiers"]["gpu"]["budget"])]
        assert (len(p.gpu_pool) == len(manifest.keys)) == all_hot
