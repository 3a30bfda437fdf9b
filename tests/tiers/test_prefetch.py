"""Lookahead prefetch: speculative routing with the next layers' routers, staged into free slots."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import tiers
from tiers.loader.layout import ExpertKey, find_experts_modules
from tiers.loader.packed import read_manifest
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
    mgr.drain()  # read-aheads hold their slot until they land
    assert all(r == 0 for p in mgr.pools for r in p.readers)
    for k, r in mgr.table.items():
        if r.slot is not None:
            assert mgr.pool_of[k.layer].owner[r.slot] == k


def _cold_manager(packed, readers=2):
    cfg = load_config({"tiers": {"gpu": {"fraction": 0.5, "staging_slots": 4}, "cpu": {"fraction": 0.0},
                                 "nvme": {"precision": "bf16", "reader_threads": readers}}})
    m = read_manifest(packed)
    return TierManager(m, cfg, plan_placement(cfg, m), device=torch.device("cpu"), progress=False)


def test_prefetched_cold_reads_run_on_reader_threads(packed_factory, monkeypatch):
    import threading

    mgr = _cold_manager(packed_factory("mixtral"))
    threads = []
    real = mgr.disk.read

    def spy(key, precision, out):
        threads.append(threading.current_thread().name)
        return real(key, precision, out)

    monkeypatch.setattr(mgr.disk, "read", spy)
    cold = [k for k in mgr.placement.cold if k.layer == 1][:2]
    assert mgr.prefetch(1, [k.expert for k in cold]) == 2
    mgr.drain()
    assert len(threads) == 2 and all(t.startswith("tiers-read") for t in threads)
    h = mgr.try_acquire(cold[0])
    mgr.wait(h)
    truth = DiskStore(mgr.manifest, ["bf16"])
    blob = mgr.manifest.blob(cold[0], "bf16")
    buf = torch.empty(blob.stride, dtype=torch.uint8)
    truth.read(cold[0], "bf16", buf)
    want = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in blob.shapes}
    blob.dequantize_into(buf, want)
    assert all(torch.equal(h.tensors[n], want[n]) for n in want)
    mgr.release(h)
    s = mgr.stats()
    assert s.prefetch["async_reads"] == 2 and s.hits["gpu"] == 1
    # a demand miss reads on the calling thread
    threads.clear()
    other = [k for k in mgr.placement.cold if k.layer == 2][0]
    mgr.release(mgr.try_acquire(other))
    assert threads == [threading.current_thread().name]


def test_failed_read_ahead_surfaces_at_the_demand_read(packed_factory, tmp_path):
    import shutil

    packed = tmp_path / "p"
    shutil.copytree(packed_factory("mixtral"), packed)
    mgr = _cold_manager(packed)
    key = [k for k in mgr.placement.cold if k.layer == 1][0]
    ref = mgr.manifest.ref(key, "bf16")
    path = packed / ref.file
    data = bytearray(path.read_bytes())
    data[ref.offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert mgr.prefetch(1, [key.expert]) == 1
    mgr.drain()
    assert mgr.stats().prefetch["async_read_errors"] == 1
    assert mgr.table[key].slot is None and all(r == 0 for p in mgr.pools for r in p.readers)
    with pytest.raises(tiers.IntegrityError, match=f"layer {key.layer} expert {key.expert}"):
        mgr.try_acquire(key)


def test_zero_reader_threads_reads_synchronously(packed_factory):
    mgr = _cold_manager(packed_factory("mixtral"), readers=0)
    cold = [k for k in mgr.placement.cold if k.layer == 0][:1]
    assert mgr.prefetch(0, [cold[0].expert]) == 1
    assert not mgr.pending and mgr.stats().prefetch["async_reads"] == 0


def test_route_ranks_the_next_layers_experts_by_votes(packed_factory):
    """Speculative routing counts, per expert of the next layer, the tokens whose top-k names it;
    the read-ahead takes the most named first (ties by id), and a prediction naming most of the
    layer lists the unnamed experts after the named ones."""
    from types import SimpleNamespace

    from tiers.integration import WHOLE_LAYER, LayerBinding, _route

    mgr = _manager(packed_factory("mixtral"))
    E, H, k, T = 8, 16, 2, 24
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(E, H, generator=g)
    hidden = torch.randn(T, H, generator=g)
    binding = LayerBinding(0, mgr, lookahead=((1, weight),))
    module = SimpleNamespace(num_experts=E)
    top_k_index = torch.randint(0, E, (T, k), generator=g)
    _route(module, binding, hidden, top_k_index)
    picks = torch.topk(hidden @ weight.t(), k, dim=-1).indices.reshape(-1).tolist()
    votes = [picks.count(e) for e in range(E)]
    expected = sorted((e for e in range(E) if votes[e]), key=lambda e: (-votes[e], e))
    if len(expected) >= WHOLE_LAYER * E:
        expected += [e for e in range(E) if not votes[e]]
    assert mgr.predicted[1] == expected
    assert len(set(votes)) > 2  # the votes differ, so the order is not the ids'
    # the read-ahead stages in that order: the first free slots go to the most named experts
    staged = mgr.prefetch(1, mgr.predicted[1], limit=2)
    want = [e for e in expected if mgr.table[ExpertKey(1, e)].slot is None or ExpertKey(1, e) in mgr.prefetched]
    assert staged == 2 and [key.expert for key in mgr.prefetched] == want[:2]
