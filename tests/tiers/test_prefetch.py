"""Lookahead prefetch: speculative routing with the next layers' routers, staged into free slots."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import tiers
from loader.layout import ExpertKey, find_experts_modules
from loader.packed import read_manifest
from tiers.config import load_config
from tiers.disk_store import DiskStore
from tiers.engine import TierManager
from tiers.integration import manager_of
from tiers.policy import plan_placement
from tiers.residency import SlotState

GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("compute,impl", [("eager", "eager"), ("grouped", "grouped_mm")])
@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_keeps_logits_bit_identical(model_type, compute, impl, depth, device, checkpoint_factory, packed_factory):
    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory(model_type), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation(impl)
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8, "compute": compute, "prefetch_depth": depth},
                     "cpu": {"fraction": 0.2, "precision": "bf16"}, "nvme": {"precision": "bf16"}}}
    model = tiers.load(packed_factory(model_type), cfg, device=device, progress=False)
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(7)).to(device)
    a, b = ref.generate(ids, **GEN), model.generate(ids, **GEN)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    p = tiers.stats(model).prefetch
    assert p["issued"] > 0 and 0 <= p["used"] <= p["issued"]
    assert 0.0 <= p["accuracy"] <= 1.0 and 0 <= p["wasted_bytes"] <= p["bytes"]
    bindings = [m._tiers_binding for _, m in find_experts_modules(model).values()]
    assert [len(x.lookahead) for x in bindings] == [min(depth, len(bindings) - 1 - i) for i in range(len(bindings))]


def _manager(packed, staging=4):
    cfg = load_config({"tiers": {"gpu": {"fraction": 0.5, "staging_slots": staging}, "cpu": {"fraction": 0.3, "precision": "bf16"},
                                 "nvme": {"precision": "bf16"}}})
    m = read_manifest(packed)
    return TierManager(m, cfg, plan_placement(cfg, m), device=torch.device("cpu"), progress=False)


def test_prefetch_stages_without_holding_and_counts_use_and_waste(packed_factory):
    mgr = _manager(packed_factory("mixtral"))
    cold = [k for k in mgr.placement.warm + mgr.placement.cold if k.layer == 1]
    assert mgr.prefetch(1, [cold[0].expert, cold[1].expert]) == 2
    for k in cold[:2]:
        assert mgr.table[k].state is SlotState.LOADING
    assert all(r == 0 for p in mgr.pools for r in p.readers)
    h = mgr.try_acquire(cold[0])  # a hit on the prefetched expert
    mgr.wait(h)
    mgr.release(h)
    s = mgr.stats()
    assert s.hits["gpu"] == 1 and s.prefetch["used"] == 1 and s.prefetch["issued"] == 2
    # fill every staging slot with other experts: the unused prefetch is evicted and counted as waste
    others = [k for k in mgr.placement.warm + mgr.placement.cold if k.layer == 2][:4]
    for k in others:
        mgr.release(mgr.try_acquire(k))
    assert mgr.stats().prefetch["wasted_bytes"] == mgr.manifest.ref(cold[1], "bf16").nbytes


def test_prefetch_never_takes_a_held_slot_and_never_evicts_its_own_work(packed_factory):
    mgr = _manager(packed_factory("mixtral"), staging=3)
    held = [mgr.try_acquire(k) for k in (mgr.placement.warm + mgr.placement.cold)[:2]]
    rest = [k.expert for k in mgr.placement.warm + mgr.placement.cold if k.layer == 2]
    assert mgr.prefetch(2, rest) == 1  # three staging slots, two held: one free
    for h in held:
        assert mgr.pool_of[h.key.layer].owner[h.slot] == h.key
        mgr.release(h)


def test_accuracy_is_predicted_and_used_over_used(packed_factory):
    mgr = _manager(packed_factory("mixtral"))
    mgr.note_prediction(1, [1, 2, 5])
    mgr.note_used(1, [2, 3])
    mgr.note_used(2, [0])  # no prediction for layer 2: not scored
    assert mgr.stats().prefetch["accuracy"] == 0.5


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 7), max_size=4, unique=True),
                          st.lists(st.integers(0, 7), max_size=6, unique=True)), min_size=1, max_size=12),
       st.integers(2, 5))
def test_prefetch_interleaved_with_layer_calls_never_corrupts_held_experts(packed_factory, calls, staging):
    packed = packed_factory("mixtral")
    mgr = _manager(packed, staging)
    truth_store = DiskStore(mgr.manifest, ["bf16"])

    def truth(key):
        blob = mgr.manifest.blob(key, "bf16")
        buf = torch.empty(blob.stride, dtype=torch.uint8)
        truth_store.read(key, "bf16", buf)
        out = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in blob.shapes}
        blob.dequantize_into(buf, out)
        return out

    for layer, used, predicted in calls:
        used = sorted(used)[: staging]
        held = mgr.acquire_layer(layer, used)
        assert held is not None
        mgr.prefetch((layer + 1) % 3, predicted)  # while this layer's experts are held
        for h in held:
            mgr.wait(h)
            want = truth(h.key)
            assert all(torch.equal(h.tensors[n], want[n]) for n in want), f"{h.key} overwritten while held"
        for h in held:
            mgr.release(h)
    assert all(r == 0 for p in mgr.pools for r in p.readers)
    for k, r in mgr.table.items():
        if r.slot is not None:
            assert mgr.pool_of[k.layer].owner[r.slot] == k
