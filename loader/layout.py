"""Expert layout: what one expert's tensors look like, discovered from the experts module.

Owns: ``ExpertKey``, ``ExpertGrid``, ``ExpertTensor`` and ``ExpertLayout``, finding the experts modules of a
model, and saying why one cannot be served (``unservable``). Discovery reads parameter names, shapes and the flags that transformers'
``use_experts_implementation`` sets on the module (``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``); it never looks at the model class.
Invariant: every 3D+ parameter whose first dimension is ``num_experts`` is an expert tensor,
and one expert's slice of it is ``param[e]``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np
import torch
from transformers.integrations import moe as _moe

# transformers' gate for experts classes without their own, which reads act_fn (None where absent)
_default_apply_gate = getattr(_moe, "_default_apply_gate", None)

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertKey(NamedTuple):
    """One expert of one MoE layer (a tuple: hashed and compared in C, on every lookup of the serving path)."""

    layer: int
    expert: int

    def __str__(self) -> str:
        return f"layer {self.layer} expert {self.expert}"


class ExpertGrid:
    """A model's experts as the cells of one flat array: layer ``L``'s row (layers in ascending
    order) times ``width`` (the most experts of any layer) plus the expert. Per-expert numbers
    (routing counts, which experts are hot) live in such arrays, so a question over every expert
    (the least used hot ones, say) is a few vector operations instead of a loop over keys; cells
    past a layer's last expert belong to no expert."""

    def __init__(self, experts: Mapping[int, int]):
        """``experts``: layer -> its expert count."""
        self.layers = sorted(experts)
        self.row = {L: i for i, L in enumerate(self.layers)}
        self.experts = dict(experts)
        self.width = max(experts.values(), default=0)
        self.size = len(self.layers) * self.width

    @classmethod
    def of(cls, keys: Iterable[ExpertKey]) -> ExpertGrid:
        """The grid of the layers ``keys`` name, each as wide as its largest expert index + 1."""
        experts: dict[int, int] = {}
        for k in keys:
            experts[k.layer] = max(experts.get(k.layer, 0), k.expert + 1)
        return cls(experts)

    def index(self, key: ExpertKey) -> int:
        if not 0 <= key.expert < self.experts.get(key.layer, 0):
            raise KeyError(f"{key} is not in this grid")
        return self.row[key.layer] * self.width + key.expert

    def key(self, i: int) -> ExpertKey:
        return ExpertKey(self.layers[i // self.width], i % self.width)

    def mask(self, keys: Iterable[ExpertKey]) -> np.ndarray:
        """bool [size]: True at ``keys``."""
        out = np.zeros(self.size, dtype=bool)
        out[[self.index(k) for k in keys]] = True
        return out

    def dense(self, counts: Mapping[ExpertKey, float], dtype=np.int64) -> np.ndarray:
        """[size] of ``counts`` (0 where absent); keys outside the grid are left out."""
        out = np.zeros(self.size, dtype=dtype)
        for k, n in counts.items():
            if 0 <= k.expert < self.experts.get(k.layer, 0):
                out[self.row[k.layer] * self.width + k.expert] = n
        return out

    def counter(self, values: np.ndarray) -> Counter:
        """The nonzero cells of ``values`` [size] by expert."""
        return Counter({self.key(int(i)): values[i].item() for i in np.flatnonzero(values)})


@dataclass(frozen=True)
class ExpertTensor:
    """One tensor of one expert: ``name`` is the experts-module parameter it is a slice of."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ExpertLayout:
    """The per-layer description of an expert: tensor names and shapes plus the forward flags."""

    num_experts: int
    tensors: tuple[ExpertTensor, ...]
    has_gate: bool = True
    has_bias: bool = False
    is_transposed: bool = False
    is_concatenated: bool = True

    def nbytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return sum(t.numel for t in self.tensors) * dtype.itemsize

    @property
    def signature(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Layers with the same signature can share GPU slots."""
        return tuple((t.name, t.shape) for t in self.tensors)

    def to_json(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "tensors": [{"name": t.name, "shape": list(t.shape)} for t in self.tensors],
            "has_gate": self.has_gate,
            "has_bias": self.has_bias,
            "is_transposed": self.is_transposed,
            "is_concatenated": self.is_concatenated,
        }

    @classmethod
    def from_json(cls, d: dict) -> ExpertLayout:
        return cls(
            num_experts=int(d["num_experts"]),
            tensors=tuple(ExpertTensor(t["name"], tuple(int(s) for s in t["shape"])) for t in d["tensors"]),
            has_gate=bool(d["has_gate"]),
            has_bias=bool(d["has_bias"]),
            is_transposed=bool(d["is_transposed"]),
            is_concatenated=bool(d["is_concatenated"]),
        )


def is_experts_module(module: torch.nn.Module) -> bool:
    """True for modules wrapped by transformers' ``use_experts_implementation``."""
    return hasattr(module, "num_experts") and hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def _expert_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The module's own parameters that hold one slice per expert (the invariant above), in order."""
    n = int(module.num_experts)
    return [(name, p) for name, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == n]


def discover_layout(module: torch.nn.Module) -> ExpertLayout:
    num_experts = int(module.num_experts)
    tensors = tuple(ExpertTensor(name, tuple(p.shape[1:])) for name, p in _expert_params(module))
    if not tensors:
        raise ValueError(f"experts module {type(module).__name__} has no parameter with a leading dim of {num_experts}")
    return ExpertLayout(
        num_experts=num_experts,
        tensors=tensors,
        has_gate=bool(module.has_gate),
        has_bias=bool(getattr(module, "has_bias", False)),
        is_transposed=bool(module.is_transposed),
        is_concatenated=bool(getattr(module, "is_concatenated", True)),
    )


def unservable(module: torch.nn.Module) -> str | None:
    """Why Tiers' experts forwards cannot serve ``module`` (None: they can).

    What the forwards read (transformers' grouped_mm and batched_mm forwards, and
    ``tiers.paths.compute.run_windows``, over a slot proxy of the module): the expert tensors
    ``gate_up_proj`` then the module's ``_apply_gate`` when ``has_gate`` (else ``up_proj`` then
    ``act_fn``), then ``down_proj``; ``<tensor>_bias`` of each when ``has_bias``;
    ``is_transposed`` for the side of each product; ``post_expert_norm`` when
    ``has_post_expert_norm``. The proxy calls the module's own ``_apply_gate``, bound to it, so a
    gate of its own (GPT-OSS: interleaved gate and up, clamped SwiGLU) needs no ``act_fn``;
    transformers' default ``_apply_gate`` and an ungated module read ``act_fn``. An expert tensor
    beyond these would be packed but left out of the computation.
    """
    if not is_experts_module(module):
        return "it is not an experts module of transformers' use_experts_implementation (no num_experts, has_gate or is_transposed)"
    gated = bool(module.has_gate)
    gate = getattr(module, "_apply_gate", None)
    if gated and not callable(gate):
        return "its experts have a gate (has_gate) but no _apply_gate to apply it"
    if (not gated or getattr(gate, "__func__", None) is _default_apply_gate) and not callable(getattr(module, "act_fn", None)):
        how = "its gate is transformers' default _apply_gate" if gated else "they have no gate"
        return f"its experts have no act_fn, which Tiers' experts forward reads where {how}"
    if getattr(module, "has_post_expert_norm", False) and not callable(getattr(module, "post_expert_norm", None)):
        return "its experts end with a norm (has_post_expert_norm) but have no post_expert_norm module"
    up, biased = ("gate_up_proj" if gated else "up_proj"), bool(getattr(module, "has_bias", False))
    wanted = {up, "down_proj"} | ({f"{up}_bias", "down_proj_bias"} if biased else set())
    have = {name for name, _ in _expert_params(module)}
    if wanted - have:
        return f"its experts have no {sorted(wanted - have)}, which the forwards read (has_gate={gated}, has_bias={biased})"
    if have - wanted:
        return f"its expert tensors {sorted(have - wanted)} are none the forwards read, so they would be left out of the computation"
    return None


def find_experts_modules(model: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Module]]:
    """Map layer index -> (qualified name, experts module). The index comes from ``layers.{i}.``."""
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        m = _LAYER_RE.search(name + ".")
        layer = int(m.group(1)) if m else len(found)
        if layer in found:
            raise ValueError(f"two experts modules claim layer {layer}: {found[layer][0]} and {name}")
        found[layer] = (name, module)
    return dict(sorted(found.items()))
