"""The transformers side: the experts forward registered in transformers' registry, and generate's decode stage.

Owns the function ``tiers`` registered in ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``
(selected with ``set_experts_implementation``; no model class is patched), which hands each
experts module's call to its manager (``Manager.serve``), and the hook that tells the manager
when generate's decode stage runs. With every tier in bf16 a call's output is bit-identical to
transformers' default (grouped_mm) experts on the untiered model, batched_mm in the decode stage
on a GPU, as transformers switches it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

IMPLEMENTATION = "tiers"


@dataclass(frozen=True)
class Binding:
    """What an experts module needs: its layer index and its manager."""

    layer: int
    manager: Any


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered experts forward: ``[T, H]``, ``[T, k]``, ``[T, k]`` -> ``[T, H]``."""
    binding = getattr(self, "_tiers_binding", None)
    if binding is None:
        raise RuntimeError(f"{type(self).__name__} has no tier binding: the tiers experts implementation serves models loaded with tiers.load")
    return binding.manager.serve(self, binding.layer, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


def follow_decode_switch(model: PreTrainedModel, manager: Any) -> None:
    """transformers' generate runs its decode stage inside ``model._optimize_model_for_decode()``,
    which on a GPU swaps grouped_mm experts for batched_mm. The tiers implementation is not
    swapped; it learns of the stage here instead (``manager.phase.decoding``). A transformers
    without the hook leaves it False: grouped kernels throughout."""
    enter = getattr(model, "_optimize_model_for_decode", None)
    if enter is None:
        return

    @contextlib.contextmanager
    def optimize_for_decode():
        phase = manager.phase
        before = phase.decoding
        phase.decoding = manager.batched_decode
        began = phase.decoding and not before
        if began:
            manager.begin_decode()
        try:
            with enter():
                yield
        finally:
            if began:
                manager.end_decode()
            phase.decoding = before

    model._optimize_model_for_decode = optimize_for_decode
