"""The rebalancer (tiers.policy.rebalancer) in whole-model runs: moving experts changes no logit.

Generate and long prompts run with the rebalancer on and every tier in bf16, against the model
without tiers (or the same tiers without the rebalancer): bit-identical. After every rebalance and
every landing the table's invariants are checked (rebalancer_helpers.py: ``checked``).
"""
from __future__ import annotations

import pytest
import torch

import tiers
from rebalancer_helpers import BF16, checked, hot_keys, plan_on_any_gain
from tiers.api import manager_of


@pytest.fixture(autouse=True)
def plans_move_on_any_gain(monkeypatch):
    """The rebalancer plans with margin 0 and significance 0 (tiny models count few lookups; the
    plan's thresholds are tests/tiers/policy/test_rebalance.py's)."""
    plan_on_any_gain(monkeypatch)


# -- generate ------------------------------------------------------------------------------------
def test_generate_with_rebalancing_is_bit_identical(device, checkpoint_factory, packed_factory):
    """All tiers bf16: moving experts between tiers while generating changes no logit."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("mixtral"), dtype=torch.bfloat16).to(device).eval()
    ref.set_experts_implementation("grouped_mm")
    cfg = {"tiers": BF16 | {"gpu": BF16["gpu"] | {"staging_slots": 8, "fraction": 0.6},
                            "rebalance": {"every_tokens": 2, "window": 2}}}
    model = tiers.load(packed_factory("mixtral"), cfg, device=device, progress=False)
    mgr = checked(manager_of(model))
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)
    s = tiers.stats(model)
    assert s.rebalance["rebalances"] >= 10 and s.rebalance["promoted_hot"] + s.rebalance["promoted_warm"] > 0
    mgr.table.check()
    mgr.close()


def test_direct_decode_tables_agree_after_swaps_land(device, packed_factory, monkeypatch):
    """Direct decode with the rebalancer swapping every two tokens: at every decode token's open,
    once its swaps have landed, the device tables equal the table (``DirectPath.agrees``) and the
    table's invariants hold; the logits equal those of the same tiers without the rebalancer
    (bf16 tiers; graphs off, so CUDA runs the CPU's calls op by op)."""
    cfg = {"tiers": {"gpu": {"fraction": 0.6, "staging_slots": 8, "graphs": False}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                     "nvme": {"precision": "bf16"}}}  # every expert not hot is warm: every layer can run direct
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3)).to(device)
    out = []
    for every in (0, 2):
        model = tiers.load(packed_factory("mixtral"), {"tiers": cfg["tiers"] | {"rebalance": {"every_tokens": every, "window": 2}}},
                           device=device, progress=False)
        mgr = manager_of(model)
        if device.type == "cpu":  # what a GPU does; the torch reference stands in for the kernel
            mgr.batched_decode = True
            mgr.staging.direct_reads = True
            mgr.direct.enabled = True
        assert mgr.direct.enabled
        opened = []
        if every:
            checked(mgr)
            open_token = mgr._open_decode_token

            def open_checked(tokens, open_token=open_token, mgr=mgr):
                open_token(tokens)
                mgr.table.check()
                opened.append((mgr.table.homes_version, mgr.direct.version, mgr.direct.agrees()))
            monkeypatch.setattr(mgr, "_open_decode_token", open_checked)
        out.append(model.generate(ids, **kw))
        if every:
            s = tiers.stats(model)
            assert s.direct["decode_calls"] > 0, "no decode call ran direct"
            assert s.rebalance["promoted_hot"] > 0, "the test needs swaps during decode"
            assert opened and all(ok for *_, ok in opened), "the device tables disagree with the table"
            assert all(v == d for v, d, _ in opened), "a decode token ran on tables older than its swaps"
            assert len({v for v, *_ in opened}) > 1, "no swap landed between decode tokens"
            mgr.rebalancer.land(wait=True)
            mgr.direct.refresh()
            assert mgr.direct.agrees()
        mgr.close()
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert all(torch.equal(x, y) for x, y in zip(out[0].logits, out[1].logits))


def test_back_to_back_long_prompts_with_rebalancing_are_bit_identical(checkpoint_factory, packed_factory):
    """Long prompts, one after another, read their layers whole (no host sync); each forward's
    calls are counted after a later forward's last layer, where the rebalances they close are
    planned and the swaps of earlier ones land. Moving experts between those forwards changes no
    logit of any prompt, nor of a generate after them (all tiers bf16, the CPU: bit-identical)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoint_factory("qwen3_moe"), dtype=torch.bfloat16).eval()
    ref.set_experts_implementation("grouped_mm")
    cfg = {"tiers": {"gpu": {"fraction": 0.4, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                     "nvme": {"precision": "bf16"},  # every expert not hot is warm: the layers can be read whole
                     "rebalance": {"every_tokens": 2, "window": 2}}}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False)
    mgr = checked(manager_of(model))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (1, 64), generator=g) for _ in range(6)]
    k = model.config.num_experts_per_tok
    assert all(mgr.whole.qualifies(L, 64, k) for L in mgr.manifest.layers if not mgr.resident.qualifies(L))
    hot0 = hot_keys(mgr)
    with torch.no_grad():
        for ids in prompts:
            assert torch.equal(ref(ids).logits, model(ids).logits)
    assert mgr.stats_.whole_calls >= len(prompts), "the prompts did not read their layers whole"
    mgr.rebalancer.land(wait=True)
    assert hot_keys(mgr) != hot0, "nothing moved between the prompts"
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    a, b = ref.generate(prompts[0], **kw), model.generate(prompts[0], **kw)
    assert torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    s = tiers.stats(model)
    assert s.rebalance["rebalances"] >= len(prompts) - 1 and s.rebalance["promoted_hot"] > 0
    mgr.close()
