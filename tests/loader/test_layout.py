"""loader.layout.unservable: what Tiers' experts forwards need from an experts module, on the
families that have it (GPT-OSS through its own gate, without act_fn), and on toy modules that each lack one thing."""
from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation

from conftest import MODELS, tiny_config
from tiers.loader.layout import find_experts_modules, unservable
from tiers.loader.skeleton import build_skeleton

E, H, I = 4, 8, 6


@pytest.mark.parametrize("model_type", list(MODELS))
def test_served_families_are_servable(model_type):
    experts = find_experts_modules(build_skeleton(tiny_config(model_type)))
    assert experts
    assert {name: unservable(mod) for name, mod in experts.values()} == {name: None for name, _ in experts.values()}


def test_gpt_oss_experts_are_servable_through_their_own_gate():
    """GPT-OSS: no act_fn, its own _apply_gate, transposed weights with biases; served."""
    config = tiny_config("gpt_oss")
    assert isinstance(config, GptOssConfig)
    experts = find_experts_modules(build_skeleton(config))
    assert len(experts) == config.num_hidden_layers  # transformers drives them through its experts registry
    for _, mod in experts.values():
        assert type(mod).__name__ == "GptOssExperts" and not hasattr(mod, "act_fn")
        assert mod.has_gate and mod.has_bias and mod.is_transposed and not mod.is_concatenated
        assert unservable(mod) is None


def _toy(*, gated=True, bias=False, act=True, extra=False, post_norm=None, own_gate=False, **flags) -> torch.nn.Module:
    """An experts module as transformers' decorator wraps one, with only what is asked for."""

    class ToyExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            up = "gate_up_proj" if gated else "up_proj"
            setattr(self, up, torch.nn.Parameter(torch.zeros(E, 2 * I if gated else I, H)))
            self.down_proj = torch.nn.Parameter(torch.zeros(E, H, I))
            if bias:
                setattr(self, f"{up}_bias", torch.nn.Parameter(torch.zeros(E, 2 * I if gated else I)))
                self.down_proj_bias = torch.nn.Parameter(torch.zeros(E, H))
            if extra:
                self.down_scale = torch.nn.Parameter(torch.ones(E, H))
            if act:
                self.act_fn = ACT2FN["silu"]
            if post_norm:
                self.post_expert_norm = torch.nn.LayerNorm(H)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    if own_gate:
        ToyExperts._apply_gate = lambda self, gate_up: gate_up[..., ::2] * gate_up[..., 1::2]

    cls = use_experts_implementation(ToyExperts, has_gate=gated, has_bias=flags.pop("has_bias", bias),
                                     has_post_expert_norm=post_norm is not None, **flags)
    return cls(None)


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(), None),
        (dict(gated=False), None),
        (dict(bias=True, is_transposed=True), None),
        (dict(post_norm=True), None),
        (dict(gated=False, act=False), "its experts have no act_fn, which Tiers' experts forward reads where they have no gate"),
        (dict(act=False), "its experts have no act_fn, which Tiers' experts forward reads where its gate is transformers' default"),
        (dict(act=False, own_gate=True), None),
        (dict(bias=True, has_bias=False), "its expert tensors ['down_proj_bias', 'gate_up_proj_bias'] are none the forwards read"),
        (dict(has_bias=True), "its experts have no ['down_proj_bias', 'gate_up_proj_bias'], which the forwards read (has_gate=True, has_bias=True)"),
        (dict(extra=True), "its expert tensors ['down_scale'] are none the forwards read, so they would be left out"),
        (dict(post_norm=False), "its experts end with a norm (has_post_expert_norm) but have no post_expert_norm module"),
    ],
    ids=["gated", "ungated", "biased_transposed", "post_norm", "no_act_fn", "default_gate_no_act_fn", "own_gate_no_act_fn", "undeclared_bias", "missing_bias", "extra_tensor",
         "no_post_norm_module"],
)
def test_toy_experts(kw, reason):
    got = unservable(_toy(**kw))
    assert got == reason if reason is None else got.startswith(reason), got


def test_a_plain_module_is_not_an_experts_module():
    assert "not an experts module" in unservable(torch.nn.Linear(2, 2))
