"""Transformers' weight converters run at pack time: a group of checkpoint tensors -> the model's tensors.

Owns: ``Converted``, one converter group (the checkpoint keys a ``WeightConverter`` collects for
one target, e.g. a linear attention's q/k/v convolutions concatenated, a fused input projection
split, interleaved gate/up rows reordered), and running it as ``from_pretrained`` would. A group
runs on meta tensors when the pack is planned (what it makes, without reading data) and on the
real tensors when it is written, one group at a time: the pack holds one group's tensors at
most (one layer's worth). An experts group runs once per expert on that expert's slices.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .skeleton import KeyMap
from .source import SourceCheckpoint

# safetensors dtype names <-> torch dtypes
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2, "I16": torch.int16, "F16": torch.float16, "BF16": torch.bfloat16,
          "I32": torch.int32, "F32": torch.float32, "I64": torch.int64, "F64": torch.float64}
NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class Converted:
    """The checkpoint keys one converter turns into model tensors."""

    target: str  # the model key the group's sources map to (names the group)
    sources: list[tuple[str, str]] = field(default_factory=list)  # (converter source pattern, checkpoint key)
    outputs: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # model key -> (dtype name, shape)

    def run(self, keymap: KeyMap, model: torch.nn.Module, read) -> dict[str, torch.Tensor]:
        """model key -> tensor, from ``read(checkpoint key)`` of every source, through the converter's operations."""
        conv = keymap.converter(self.sources[0][0])
        for pattern, key in self.sources:
            conv.add_tensor(self.target, key, pattern, read(key))
        try:
            out = conv.convert(self.target, model=model, config=model.config)
        except Exception as e:  # noqa: BLE001 (converter operations raise many types)
            keys = [k for _, k in self.sources]
            raise ValueError(f"{model.config.model_type}: transformers' weight converter for {self.target!r} failed on "
                             f"checkpoint keys {keys[:4]} ({type(e).__name__}: {e})") from None
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def plan_outputs(group: Converted, keymap: KeyMap, model: torch.nn.Module, src: SourceCheckpoint) -> None:
    """Fill ``group.outputs``: run it on meta tensors of the sources' shapes, or, where an operation
    needs real data, on the tensors themselves."""
    group.sources.sort(key=lambda pk: _natural(pk[1]))
    metas = {k: src.meta(k) for _, k in group.sources}
    try:
        out = group.run(keymap, model, lambda k: torch.empty(metas[k][1], dtype=DTYPES[metas[k][0]], device="meta"))
    except ValueError:
        out = group.run(keymap, model, src.get)
    group.outputs = {k: (NAMES[v.dtype], list(v.shape)) for k, v in out.items()}


def expert_slice(group: Converted, keymap: KeyMap, model: torch.nn.Module, src: SourceCheckpoint, name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s slice of the experts tensor ``name`` (a full model key), converted from the
    sources' slices ``[e]``."""
    out = group.run(keymap, model, lambda k: src.get_expert(k, e).unsqueeze(0))
    if name not in out:
        raise ValueError(f"{model.config.model_type}: transformers' weight converter for {group.target!r} made "
                         f"{sorted(out)}, not the experts tensor {name!r}")
    return out[name][0]


def _natural(key: str) -> list:
    """Dotted key order with numbers compared as numbers (experts 2 before 10), as transformers sorts them."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]
