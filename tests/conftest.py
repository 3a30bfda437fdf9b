"""Shared fixtures: devices, and tiny random-weight MoE checkpoints built from configs (no download)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

logging.getLogger("transformers").setLevel(logging.ERROR)

HAS_CUDA = torch.cuda.is_available()

# Six architectures whose experts go through transformers' experts registry (GPT-OSS: transposed
# weights, biases, its own clamped SwiGLU gate over interleaved gate and up columns).
# 8 experts, top-2, 3 layers: small enough for CI, big enough that every tier holds experts.
COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=128, num_experts_per_tok=2)
MODELS = {
    "mixtral": dict(num_local_experts=8, intermediate_size=96),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=48, intermediate_size=96, shared_expert_intermediate_size=64,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=48, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": dict(num_experts=8, intermediate_size=48, eos_token_id=1, pad_token_id=0),
    "deepseek_v3": dict(n_routed_experts=8, moe_intermediate_size=48, intermediate_size=96, first_k_dense_replace=1,
                        n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=8, n_group=1, topk_group=1, num_hidden_layers=4, num_key_value_heads=4),
    "gpt_oss": dict(num_local_experts=8, intermediate_size=48, head_dim=16),
}

# Families transformers drives through its experts registry that Tiers cannot serve yet
# (loader.layout.unservable says why; pack refuses them). Not in MODELS: nothing packs them. None today.
UNSERVABLE: dict[str, dict] = {}


def devices() -> list:
    """cpu always; cuda marked, and skipped with a reason where there is none."""
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")])]


@pytest.fixture(params=devices())
def device(request) -> torch.device:
    return torch.device(request.param)


def tiny_config(model_type: str, **overrides):
    """The tiny config of ``model_type``; ``overrides`` replace its keys (more experts, layers, positions)."""
    kw = {**COMMON, **{**MODELS, **UNSERVABLE}[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kw)


def save_tiny(model_type: str, path: Path, *, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.bfloat16)
    # Default init (std 0.02) makes near-uniform logits; larger weights make routing and logits decisive.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.normal_(0.0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """(model_type, **opts) -> directory written by save_pretrained; cached for the session."""
    cache: dict[tuple, Path] = {}

    def make(model_type: str, max_shard_size: str | None = None) -> Path:
        key = (model_type, max_shard_size)
        if key not in cache:
            cache[key] = save_tiny(model_type, tmp_path_factory.mktemp(f"hf-{model_type}"), max_shard_size=max_shard_size)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def packed_factory(tmp_path_factory, checkpoint_factory):
    """(model_type, precisions) -> packed directory; cached for the session. Treat it as read-only."""
    from tiers.loader.pack import pack

    cache: dict[tuple, Path] = {}

    def make(model_type: str, precisions: tuple[str, ...] = ("bf16", "int8")) -> Path:
        key = (model_type, tuple(precisions))
        if key not in cache:
            dst = tmp_path_factory.mktemp(f"packed-{model_type}") / "packed"
            pack(checkpoint_factory(model_type), dst, precisions=precisions, progress=False)
            cache[key] = dst
        return cache[key]

    return make


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte of a file in place (XOR 0xFF), for the integrity tests."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
