"""Pack -> tiers.load -> forward/generate on six architectures, against the untiered model.

Exactness: with every tier in bf16, prefill logits and 8 greedy decode steps are bit-identical
(torch.equal) to transformers' own model running its default experts implementation (grouped_mm,
batched_mm in generate's decode stage where transformers switches to it), whichever path serves
each call; each path is shown reached (a spy on its ``run``) and exact on its own.
Quality: with INT8 warm and cold tiers, logits stay within a stated SQNR and KL bound.
Also: the errors ``load`` raises, and the stats.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import tiers
from conftest import MODELS
from tiers.api import manager_of
from tiers.config import load_config
from tiers.hf import IMPLEMENTATION
from tiers.loader.layout import ExpertKey, find_experts_modules
from tiers.loader.packed import read_manifest
from tiers.paths import compute, resident, whole
from tiers.policy.placement import plan_placement
from tiers.store.table import SlotState
from untiered import GEN, assert_bit_identical, assert_consistent, assert_generate_equal, prompt, reference, spy_paths

# a quarter of the experts hot, 40% warm, the rest on disk: misses from both, most calls streamed (3 staging slots)
BF16_EVERYWHERE = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.4, "precision": "bf16"}, "nvme": {"precision": "bf16"}}}
# more of the GPU, 8 staging slots: a layer's experts fit them, calls are held
BF16_HELD = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"fraction": 0.2, "precision": "bf16"}, "nvme": {"precision": "bf16"}}}
INT8_TIERS = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.4, "precision": "int8"}, "nvme": {"precision": "int8"}}}

# INT8 per-row weights measure about 43 dB SQNR each (GPT-OSS's transposed weights scaled per
# column, its biases exact: 43.9-44.3 dB). Two bounds, both stated and tested:
# - per MoE layer, with routing held fixed: the experts' output SQNR >= 35 dB (measured 38.1-39.4 dB;
#   GPT-OSS 39.6-40.4 dB);
# - end to end: the median over tokens of the logits' SQNR >= 30 dB (measured 35.9-43.3 dB; GPT-OSS 38.5 dB, KL 3.0e-5) and
#   the mean KL(bf16 || int8) <= 1e-2 nats per token (measured 2.7e-5 to 1.1e-3, transformers 5.17 and 5.24). The median, not
#   the mean, because a token whose router is near a tie can pick a different expert under INT8
#   noise (seen: 3 of 64 tokens in the tiny DeepSeek-V3) and then differs by far more than the
#   quantization noise; the KL bound still counts those tokens.
INT8_LAYER_SQNR_DB = 35.0
INT8_LOGIT_MEDIAN_SQNR_DB = 30.0
INT8_KL_MAX = 1e-2


def _no_graphs(cfg: dict) -> dict:
    """``cfg`` with graphs off: every layer call runs its path's ``run`` on the host, op by op (on
    CUDA step and decode graphs would replay them; tests/tiers/graphs/ checks those)."""
    return {"tiers": cfg["tiers"] | {"gpu": cfg["tiers"].get("gpu", {}) | {"graphs": False}}}


# -- bit-identical through the three tiers ---------------------------------------------------------------
@pytest.mark.parametrize("cfg", [BF16_EVERYWHERE, BF16_HELD], ids=["streamed", "held"])
@pytest.mark.parametrize("model_type", list(MODELS))
def test_bf16_tiers_are_bit_identical(model_type, cfg, device, checkpoint_factory, packed_factory):
    ref = reference(checkpoint_factory(model_type), device)
    model = tiers.load(packed_factory(model_type), cfg, device=device, progress=False)
    assert model.config._experts_implementation == IMPLEMENTATION == "tiers"
    assert_bit_identical(ref, model, prompt(device))
    s = tiers.stats(model).as_dict()
    assert s["hits"]["cpu"] > 0 and s["hits"]["nvme"] > 0, "misses must be served from both the cpu and the nvme tier"
    assert s["bytes_moved"]["cpu"] > 0 and s["bytes_moved"]["nvme"] > 0
    assert_consistent(manager_of(model))


@pytest.mark.parametrize("gap", [1, 3])
def test_grouped_windows_are_bit_identical_to_grouped_mm(gap, device, checkpoint_factory, packed_factory, monkeypatch):
    """Grouped GEMMs over windows of the slab (a small gap forces several per call) compute what
    one GEMM over every slot computes: prefill and decode logits bit-identical to grouped_mm."""
    monkeypatch.setattr(compute, "WINDOW_GAP", gap)
    seen = []
    run = compute.run_windows
    monkeypatch.setattr(compute, "run_windows", lambda px, xs, wins, *a: seen.append(len(wins)) or run(px, xs, wins, *a))
    ref = reference(checkpoint_factory("mixtral"), device)
    model = tiers.load(packed_factory("mixtral"), BF16_HELD, device=device, progress=False)
    assert_bit_identical(ref, model, prompt(device))
    assert seen and max(seen) > 1, f"no call used more than one window ({sorted(set(seen))})"


# -- each path, reached and exact ---------------------------------------------------------------------------
# per path: the config, the prompt (batch, length), whether the CPU runs the GPU's decode logic (the decode
# switch and direct decode through the reference kernel), and which calls must reach the path
PATH_CASES = {
    # every expert hot: every call, prefill and decode
    "resident": ({"tiers": {"gpu": {"fraction": 1.0}}}, (2, 10), False),
    # 8 staging slots hold a call's every expert: every call (decode through direct's fallback: direct off)
    "held": (BF16_HELD, (2, 10), False),
    # 2 staging slots: the prefill's calls (20 tokens, picks on the host) need more
    "streamed": ({"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 2}, "cpu": {"fraction": 0.4, "precision": "bf16"},
                            "nvme": {"precision": "bf16"}}}, (2, 10), False),
    # every expert hot or warm, a 64-token prompt (128 rows: long enough to route to every expert)
    "whole": ({"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                         "nvme": {"precision": "bf16"}}}, (1, 64), False),
    # every expert hot or warm, 8 staging slots reserved in the decode stage
    "direct": ({"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                          "nvme": {"precision": "bf16"}}}, (2, 10), True),
}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])  # gpt_oss: transposed weights, biases, its own gate
@pytest.mark.parametrize("path", list(PATH_CASES))
def test_each_path_is_reached_and_bit_identical(path, model_type, device, checkpoint_factory, packed_factory, monkeypatch):
    """The dispatch sends the calls each case is built for to that path (a spy on the path
    object's ``run``), and the prefill logits and every greedy decode step are bit-identical to
    the untiered model's. ``direct``: on the CPU the decode switch and the direct path are switched
    on, the reference kernel standing in for the GPU's, against an untiered model whose decode runs
    batched_mm as on a GPU."""
    cfg, (batch, length), gpu_decode = PATH_CASES[path]
    ref = reference(checkpoint_factory(model_type), device, batched_decode=gpu_decode)
    model = tiers.load(packed_factory(model_type), _no_graphs(cfg), device=device, progress=False)
    mgr = manager_of(model)
    if gpu_decode and device.type == "cpu":
        mgr.batched_decode = True
        mgr.staging.direct_reads = True
    mgr.direct.enabled = path == "direct"  # elsewhere off: on a GPU it would take the decode steps
    calls = spy_paths(monkeypatch, mgr)
    layers = len(mgr.manifest.layers)
    ids = prompt(device, batch, length)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits), "prefill logits differ"
    prefill = dict(calls)
    mgr.reset_stats()  # settles the whole-layer calls: each layer's share of its warm experts used
    again = sum(mgr.whole.used_share.get(L, 0.0) >= whole.USED for L in mgr.manifest.layers)
    calls.clear()
    assert_generate_equal(ref.generate(ids, **GEN), model.generate(ids, **GEN))
    steps = GEN["max_new_tokens"] - 1
    s = tiers.stats(model)
    if path == "resident":
        assert prefill == {"resident": layers} and dict(calls) == {"resident": layers * (1 + steps)}
        assert s.hits["cpu"] == s.hits["nvme"] == 0 and s.hits["gpu"] > 0
    elif path == "held":
        assert prefill == {"held": layers} and dict(calls) == {"held": layers * (1 + steps)}
        assert s.streamed["calls"] == 0 and s.direct["decode_calls"] == 0
    elif path == "streamed":
        assert prefill == {"streamed": layers}, prefill
        assert s.streamed["calls"] == calls["streamed"] > 0 and s.streamed["whole"] == 0
        assert s.streamed["parts"] > s.streamed["calls"]
    elif path == "whole":
        assert prefill == {"whole": layers}, prefill
        # generate's prefill: whole again where the first one used nearly every warm expert (a decode step never)
        assert calls["whole"] == s.streamed["whole"] == again > 0
        assert calls["whole"] + calls["held"] + calls["streamed"] == layers * (1 + steps)
    else:
        assert calls["direct"] == layers * steps and s.direct["decode_calls"] == layers * steps
        assert calls["held"] + calls["streamed"] == layers, "the prefill is host-routed"
        assert s.hits["cpu"] > 0, "direct calls decoded warm experts"
    assert_consistent(mgr)


# -- transformers' decode switch -------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_all_hot_layers_follow_transformers_decode_switch(model_type, device, checkpoint_factory, packed_factory, monkeypatch):
    """generate's decode stage runs transformers' grouped_mm experts as batched_mm on a GPU (not on
    the CPU). Layers whose experts are all hot do the same, so Tiers at a 100% budget runs the
    untiered model's kernels: batched in every decode step, grouped in prefill, bit-identical logits.
    On the CPU the switch is forced on both models to run the same logic."""
    calls = {"batched": 0, "grouped": 0}
    batched, grouped = resident.batched_mm_experts_forward, resident.grouped_mm_experts_forward
    monkeypatch.setattr(resident, "batched_mm_experts_forward", lambda *a: calls.__setitem__("batched", calls["batched"] + 1) or batched(*a))
    monkeypatch.setattr(resident, "grouped_mm_experts_forward", lambda *a: calls.__setitem__("grouped", calls["grouped"] + 1) or grouped(*a))
    ref = reference(checkpoint_factory(model_type), device, batched_decode=True)
    model = tiers.load(packed_factory(model_type), {"tiers": {"gpu": {"fraction": 1.0, "graphs": False}}}, device=device, progress=False)
    mgr = manager_of(model)
    layers = len(mgr.manifest.layers)
    assert all(mgr.resident.qualifies(L) for L in mgr.manifest.layers)
    mgr.batched_decode = True  # what a GPU does; the CPU default is False, as in transformers
    ids = prompt(device)
    a, b = ref.generate(ids, **GEN), model.generate(ids, **GEN)
    assert calls == {"grouped": layers, "batched": layers * (GEN["max_new_tokens"] - 1)}, calls
    assert not mgr.phase.decoding, "the decode flag must be cleared when generate returns"
    assert_generate_equal(a, b)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_tiered_layers_follow_transformers_decode_switch(model_type, device, checkpoint_factory, packed_factory, monkeypatch):
    """In generate's decode stage (on a GPU; forced here on the CPU) host-routed layers run
    transformers' batched_mm too, with each pick's slot as its expert id: the logits are
    bit-identical to the untiered model's, whose decode runs batched_mm."""
    calls = []
    batched = compute.batched_mm_experts_forward
    monkeypatch.setattr(compute, "batched_mm_experts_forward", lambda *a: calls.append(a[2].shape) or batched(*a))
    ref = reference(checkpoint_factory(model_type), device, batched_decode=True)
    model = tiers.load(packed_factory(model_type), _no_graphs(BF16_HELD), device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True
    mgr.direct.enabled = False  # the host-routed path, which direct decode would take over on a GPU
    layers = len(mgr.manifest.layers)
    assert not all(mgr.resident.qualifies(L) for L in mgr.manifest.layers), "some layer must stage experts"
    ids = prompt(device)
    a = ref.generate(ids, **GEN)
    mgr.reset_stats()
    b = model.generate(ids, **GEN)
    assert len(calls) == layers * (GEN["max_new_tokens"] - 1), len(calls)
    s = tiers.stats(model)
    assert s.hits["cpu"] + s.hits["nvme"] > 0, "decode must stage experts"
    assert_generate_equal(a, b)
    assert_consistent(mgr)


def test_decode_switch_stays_off_on_the_cpu_by_default(packed_factory, monkeypatch):
    used = []
    monkeypatch.setattr(resident, "batched_mm_experts_forward", lambda *a: used.append(1))
    monkeypatch.setattr(compute, "batched_mm_experts_forward", lambda *a: used.append(1))
    model = tiers.load(packed_factory("mixtral"), {"tiers": {"gpu": {"fraction": 1.0}}}, device="cpu", progress=False)
    model.generate(prompt(torch.device("cpu")), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    mgr = manager_of(model)
    assert not used and not mgr.batched_decode and not mgr.direct.enabled


def test_one_token_decode_reads_its_two_picks_in_place(device, checkpoint_factory, packed_factory, monkeypatch):
    """Batch-1 decode of a top-2 model through host-routed layers: every held call runs on the
    picks' slots in place (``compute.picked``), and the logits equal the untiered model's."""
    used = []
    picked = compute.picked
    monkeypatch.setattr(compute, "picked", lambda px, slots: used.append(slots) or picked(px, slots) or used.pop())
    ref = reference(checkpoint_factory("mixtral"), device, batched_decode=True)
    model = tiers.load(packed_factory("mixtral"), _no_graphs(BF16_HELD), device=device, progress=False)
    mgr = manager_of(model)
    mgr.batched_decode = True
    mgr.direct.enabled = False  # the host-routed path, which direct decode would take over
    ids = prompt(device, batch=1)
    a, b = ref.generate(ids, **GEN), model.generate(ids, **GEN)
    staged = sum(not mgr.resident.qualifies(L) for L in mgr.manifest.layers)
    assert len(used) == staged * (GEN["max_new_tokens"] - 1) and all(len(s) == 2 and s[0] < s[1] for s in used), used
    assert_generate_equal(a, b)


# -- INT8 within its bound -----------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_int8_tiers_within_bound(model_type, device, checkpoint_factory, packed_factory):
    ref = reference(checkpoint_factory(model_type), device)
    model = tiers.load(packed_factory(model_type), INT8_TIERS, device=device, progress=False)
    ids = prompt(device, batch=4, length=16)
    with torch.no_grad():
        a = ref(ids).logits.float()  # [B, T, V]
        b = model(ids).logits.float()
    assert not torch.equal(a, b), "int8 tiers should not be bit-exact; is the int8 path in use?"
    per_token = 10 * torch.log10(a.pow(2).sum(-1) / (a - b).pow(2).sum(-1))  # [B, T]
    kl = F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="none").sum(-1).mean().item()
    assert per_token.median().item() >= INT8_LOGIT_MEDIAN_SQNR_DB, f"median logit SQNR {per_token.median():.1f} dB"
    assert kl <= INT8_KL_MAX, f"KL {kl:.2e} per token above {INT8_KL_MAX}"


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_int8_expert_outputs_within_bound(model_type, device, checkpoint_factory, packed_factory):
    """Routing held fixed: the same hidden states and top-k through the bf16 experts and the int8 tiers."""
    ref = reference(checkpoint_factory(model_type), device)
    model = tiers.load(packed_factory(model_type), INT8_TIERS, device=device, progress=False)
    g = torch.Generator().manual_seed(3)
    for layer, (name, mod) in find_experts_modules(model).items():
        ref_mod = ref.get_submodule(name)
        k = model.config.num_experts_per_tok
        hidden = ref_mod.down_proj.shape[-1 if mod.is_transposed else -2]
        x = torch.randn(64, hidden, generator=g).to(device, torch.bfloat16)  # [T, H]
        idx = torch.stack([torch.randperm(mod.num_experts, generator=g)[:k] for _ in range(64)]).to(device)  # [T, k]
        w = torch.softmax(torch.randn(64, k, generator=g), -1).to(device, torch.bfloat16)  # [T, k]
        with torch.no_grad():
            want, got = ref_mod(x, idx, w), mod(x, idx, w)
        sqnr = 10 * torch.log10(want.float().pow(2).sum() / (want.float() - got.float()).pow(2).sum()).item()
        assert sqnr >= INT8_LAYER_SQNR_DB, f"layer {layer}: experts output SQNR {sqnr:.1f} dB"


# -- all-hot layers: the resident path ------------------------------------------------------------------
def test_all_hot_layers_take_the_resident_path(device, checkpoint_factory, packed_factory):
    """With every expert hot, layers run on their row of the slabs with their own ids: same logits
    as grouped_mm, hits counted (one-token calls on the host, longer ones on the device)."""
    ref = reference(checkpoint_factory("qwen3_moe"), device)
    model = tiers.load(packed_factory("qwen3_moe"), {"tiers": {"gpu": {"fraction": 1.0}}}, device=device, progress=False)
    mgr = manager_of(model)
    layers = sorted(read_manifest(packed_factory("qwen3_moe")).layers)
    assert sorted(mgr.resident.views) == layers and all(mgr.resident.qualifies(L) for L in layers)
    # loaded in order, each layer's slots are in a row: it runs on views of the slabs (no copy, its own ids)
    for L, view in mgr.resident.views.items():
        pool = mgr.pool_of[L]
        first = mgr.table[ExpertKey(L, 0)].slot
        assert [mgr.table[ExpertKey(L, e)].slot for e in range(8)] == list(range(first, first + 8))
        for name, t in view.items():
            assert t.data_ptr() == pool.slabs[name][first].data_ptr() and t.shape[0] == 8
    seen = []
    for _, mod in find_experts_modules(model).values():
        mod.register_forward_pre_hook(lambda m, args: seen.append(torch.unique(args[1]).numel()))
    ids = prompt(device)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)
    s = tiers.stats(model)
    assert s.hits == {"gpu": sum(seen), "cpu": 0, "nvme": 0}
    assert s.misses["gpu"] == 0
    seen.clear()
    before = tiers.stats(model).hits["gpu"]
    one = ids[:1, :1]
    with torch.no_grad():
        model(one)
        model(ids[:1])
    assert tiers.stats(model).hits["gpu"] - before == sum(seen)
    mgr.reset_stats()
    assert tiers.stats(model).hits["gpu"] == 0
    with torch.no_grad():
        model(one)
    assert tiers.stats(model).hits["gpu"] == sum(seen[-len(layers):])


def test_resident_hits_count_each_calls_distinct_experts_across_folds(device, packed_factory):
    """A resident layer's calls mark their distinct experts in rows that are summed when the rows
    run out or the stats are read: over more calls than rows, with resets between, the count is
    the sum of each call's distinct experts (the sentinel id, expert parallelism's, not counted)."""
    model = tiers.load(packed_factory("qwen3_moe"), {"tiers": {"gpu": {"fraction": 1.0}}}, device=device, progress=False)
    mgr = manager_of(model)
    layers = sorted(mgr.resident.views)
    n = mgr.manifest.layers[layers[0]].layout.num_experts
    rng = torch.Generator().manual_seed(0)
    rows = mgr.resident.MARK_ROWS
    expected = 0
    mgr.reset_stats()
    for call in range(3 * rows + 37):
        L = layers[call % 3 == 0]  # two thirds of the calls to one layer: each layer folds at its own pace
        T = int(torch.randint(2, 9, (1,), generator=rng))
        idx = torch.randint(0, n + 1, (T, 2), generator=rng)  # n: the sentinel
        mgr.resident.count(L, idx.to(device))
        expected += len(set(idx.reshape(-1).tolist()) - {n})
        if call == 2 * rows + 5:  # the first layer's rows have run out once, then 25 more calls
            assert tiers.stats(model).hits["gpu"] == expected  # mid-row: the pending rows count
        if call == 2 * rows + 20:
            mgr.reset_stats()  # pending rows are dropped with the rest
            expected = 0
    assert tiers.stats(model).hits["gpu"] == expected
    assert tiers.stats(model).hits["gpu"] == expected  # reading folds nothing twice


# -- stats and memory --------------------------------------------------------------------------------
def test_residency_matches_yaml(device, packed_factory):
    packed = packed_factory("mixtral")
    model = tiers.load(packed, INT8_TIERS, device=device, progress=False)
    s = tiers.stats(model)
    m = read_manifest(packed)
    n = len(m.keys)
    # Independent arithmetic from the manifest, per the documented accounting.
    slot = m.layers[0].layout.nbytes()
    stride = m.layers[0].blobs["int8"].stride
    gpu_budget = int(0.25 * n * slot)
    # auto staging: 4 x top-k (2) for experts this small (a part of half of them carries far less
    # than 64 MiB), a transit row each, lowered until they take at most half the budget
    staging = 4 * 2
    while staging > 1 and staging * (slot + stride) > gpu_budget // 2:
        staging -= 1
    hot = (gpu_budget - staging * (slot + stride)) // slot
    warm = int(0.4 * n * stride) // stride
    assert s.residency["gpu"]["experts"] == hot
    assert s.residency["cpu"]["experts"] == warm
    assert s.residency["nvme"]["experts"] == n - hot - warm
    assert s.residency["gpu"]["bytes"] == hot * slot
    assert s.residency["cpu"]["bytes"] == warm * stride
    assert s.memory["gpu_bytes"] <= s.memory["gpu_budget"] == gpu_budget
    assert s.memory["host_pool_bytes"] <= s.memory["cpu_budget"]
    assert s.gpu_slots == {"hot": hot, "staging": staging, "cached": 0}
    text = str(s)
    assert "gpu" in text and "nvme" in text and "hit rate" in text
    assert s.gpu_hit_rate == 0.0 and "gpu hit rate 0.0% of 0 lookups" in text  # none yet: 0, not a division by zero
    counted = replace(s, hits={"gpu": 3, "cpu": 1, "nvme": 0})
    assert counted.gpu_hit_rate == 0.75 and "gpu hit rate 75.0% of 4 lookups" in str(counted)
    assert s.read_ahead == {"reads": 0, "errors": 0}
    assert s.as_dict()["gpu_slots"] == s.gpu_slots and s.as_dict()["residency"] == s.residency


def test_stats_count_a_forward_and_reset(device, packed_factory):
    """After a forward every lookup is a hit of one tier; a miss of the GPU is a hit of cpu or
    nvme, and of the cpu a hit of nvme; bytes moved are blobs; reset starts from zero."""
    packed = packed_factory("mixtral")
    model = tiers.load(packed, INT8_TIERS, device=device, progress=False)
    with torch.no_grad():
        model(prompt(device))
    s = tiers.stats(model)
    assert sum(s.hits.values()) > 0 and s.hits["cpu"] > 0 and s.hits["nvme"] > 0
    assert s.misses["gpu"] == s.hits["cpu"] + s.hits["nvme"] and s.misses["cpu"] == s.hits["nvme"]
    blob = read_manifest(packed).layers[0].blobs["int8"].nbytes
    assert s.bytes_moved["cpu"] % blob == 0 and s.bytes_moved["nvme"] == blob * s.hits["nvme"]
    assert s.gpu_slots["cached"] > 0, "staged experts stay cached in their slots"
    manager_of(model).reset_stats()
    s = tiers.stats(model)
    assert sum(s.hits.values()) == sum(s.misses.values()) == sum(s.bytes_moved.values()) == 0
    assert s.streamed == {"calls": 0, "parts": 0, "whole": 0, "unused": 0, "unused_bytes": 0}


def test_slot_memory_within_gpu_budget_every_fraction(packed_factory):
    packed = packed_factory("qwen3_moe")
    for frac in (0.15, 0.3, 0.5, 0.8, 1.0):
        cfg = load_config({"tiers": {"gpu": {"fraction": frac}, "cpu": {"fraction": 0.0}}})
        pl = plan_placement(cfg, read_manifest(packed))
        model = tiers.load(packed, cfg, device="cpu", progress=False)
        mgr = manager_of(model)
        allocated = sum(p.nbytes for p in mgr.pools) + sum(t.numel() for t in mgr.staging.transit.values())
        assert allocated == pl.gpu_bytes <= pl.gpu_budget


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_memory_within_budget(packed_factory):
    """CUDA twin of test_slot_memory_within_gpu_budget_every_fraction: what the device allocates
    building the manager and staging every expert of every layer stays within the gpu budget."""
    from tiers.manager import Manager

    packed = packed_factory("mixtral")
    cfg = load_config(INT8_TIERS)
    manifest = read_manifest(packed)
    pl = plan_placement(cfg, manifest)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    mgr = Manager(manifest, cfg, pl, device=torch.device("cuda"), progress=False)
    for key in manifest.keys:
        h = mgr.slots.acquire(key)
        mgr.slots.wait_all([h])
        mgr.slots.release_all([h])
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= pl.gpu_budget
    mgr.close()


def test_host_pool_and_copies_on_the_copy_stream(device, packed_factory):
    """A cold miss staged on the copy stream: the slot is held with a pending write until the
    compute stream waits on its ready event, then released with a last read. On CUDA the host
    pool is pinned, and the copy finishes while the compute stream is still busy (a sleep kernel
    queued before it): it ran on its own stream."""
    model = tiers.load(packed_factory("mixtral"), INT8_TIERS, device=device, progress=False)
    mgr = manager_of(model)
    cuda = device.type == "cuda"
    assert mgr.host.pinned == cuda and (not cuda or mgr.host.slab.is_pinned())
    assert mgr.staging.copy_stream is not mgr.streams.current()
    cold = mgr.placement.cold[0]
    pool = mgr.pool_of[cold.layer]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # keep the compute stream busy for about a second
    h = mgr.slots.acquire(cold)
    assert h.key == cold and mgr.table[cold].slot == h.slot and mgr.table.state(pool.index, h.slot) is SlotState.IN_USE
    ready = mgr.table.ready_event(pool.index, h.slot)
    assert ready is not None, "the copy's ready event is what the compute stream waits on"
    if cuda:
        ready.synchronize()
        assert not torch.cuda.current_stream().query(), "the staged copy waited for the compute stream"
    mgr.slots.wait_all([h])
    assert mgr.table.ready_event(pool.index, h.slot) is None
    mgr.slots.release_all([h])
    assert mgr.table.state(pool.index, h.slot) is SlotState.READY and mgr.table.last_read(pool.index, h.slot) is not None
    if cuda:
        torch.cuda.synchronize()
    s = tiers.stats(model)
    assert s.hits["nvme"] == 1 and s.misses["gpu"] == 1


# -- load: defaults and errors ----------------------------------------------------------------------------
def test_default_device_and_config(packed_factory, capsys):
    model = tiers.load(packed_factory("olmoe"), None)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(model.parameters()).device.type == expected
    assert model.config._experts_implementation == "tiers"  # the only implementation
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tiers: ")]
    assert [line.split()[1] for line in lines] == ["gpu:", "cpu:", "nvme:"], "one summary line per tier"
    out = model.generate(prompt(next(model.parameters()).device, 1, 4), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def test_not_packed_directory_is_a_clear_error(tmp_path, checkpoint_factory):
    with pytest.raises(ValueError, match="not a packed checkpoint"):
        tiers.load(checkpoint_factory("mixtral"), device="cpu")
    with pytest.raises(ValueError, match="is not a directory"):
        tiers.load(tmp_path / "nope", device="cpu")


def test_missing_config_json_is_named(tmp_path, packed_factory):
    import shutil

    packed = tmp_path / "p"
    shutil.copytree(packed_factory("mixtral"), packed)
    (packed / "config.json").unlink()
    with pytest.raises(tiers.IntegrityError, match=r"carried file '.*config\.json' is missing"):
        tiers.load(packed, device="cpu", progress=False)


def test_manager_of_a_model_not_loaded_by_tiers(checkpoint_factory):
    ref = reference(checkpoint_factory("mixtral"), torch.device("cpu"))
    with pytest.raises(ValueError, match="not loaded with tiers.load"):
        manager_of(ref)
    with pytest.raises(ValueError, match="not loaded with tiers.load"):
        tiers.stats(ref)


@pytest.mark.parametrize("device,match", [("tpu", "is not a device"), ("nonsense", "is not a device"), ("meta", "expected cuda or cpu, got meta")])
def test_a_device_tiers_cannot_use_is_named(device, match, packed_factory):
    with pytest.raises(ValueError, match=f"device: .*{match}"):
        tiers.load(packed_factory("mixtral"), device=device, progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a torch without CUDA gives")
def test_cuda_without_cuda_is_named(packed_factory):
    with pytest.raises(ValueError, match="sees no CUDA device.*load with device='cpu'"):
        tiers.load(packed_factory("mixtral"), device="cuda", progress=False)
