"""Every tier in one precision serves the same weights as every expert hot from that precision.

A pack holds each expert once per precision; whichever tier serves an expert (hot on the device,
warm in pinned memory, cold read from the file) decodes the same blob with the same scheme into a
bf16 slot. So with every tier in precision P, prefill logits and every greedy decode step are
bit-identical (torch.equal) to the same pack loaded with every expert hot, dequantized from P at
load: the tiers move bytes, they must not change a bit. Quantization error is not what this
checks (tests/quant and tools/quality do); qwen3_moe's weights are stored [out, in], gpt_oss's
[in, out] (int4's ``codes_t``), with biases (kept bf16).
"""
from __future__ import annotations

import pytest
import torch

import tiers
from tiers.api import manager_of
from untiered import GEN, assert_consistent, assert_generate_equal, prompt

PACKED = ("bf16", "int4", "nf4")


def hot(p: str) -> dict:
    return {"tiers": {"gpu": {"fraction": 1.0, "precision": p}}}


def tiered(p: str) -> dict:
    return {"tiers": {"gpu": {"fraction": 0.25, "precision": p}, "cpu": {"fraction": 0.25, "precision": p},
                      "nvme": {"precision": p}}}


@pytest.mark.parametrize("precision", PACKED)
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_every_tier_in_one_precision_is_bit_identical_to_it_all_hot(model_type, precision, device, packed_factory):
    if precision == "nf4":
        pytest.importorskip("bitsandbytes")
    root = packed_factory(model_type, PACKED)
    ref = tiers.load(root, hot(precision), device=device, progress=False)
    model = tiers.load(root, tiered(precision), device=device, progress=False)
    ids = prompt(device)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits), "prefill logits differ"
    assert_generate_equal(ref.generate(ids, **GEN), model.generate(ids, **GEN))
    s = tiers.stats(model).as_dict()
    for tier in ("gpu", "cpu", "nvme"):
        assert s["residency"][tier]["experts"] > 0 and s["hits"][tier] > 0, f"the {tier} tier served no experts: {s['hits']}"
    assert tiers.stats(ref).as_dict()["hits"]["cpu"] == 0
    assert_consistent(manager_of(model))
    if precision != "bf16":  # the precision was used: not the bf16 weights
        bf16 = tiers.load(root, hot("bf16"), device=device, progress=False)
        with torch.no_grad():
            assert not torch.equal(bf16(ids).logits, model(ids).logits)
