"""A model skeleton: the transformers model built from config.json with every parameter on
the meta device and every buffer real (on the CPU).

Owns: building that skeleton, and the mapping of checkpoint keys to the skeleton's own names.
Parameters cost nothing on meta; buffers (rotary tables and the like) are computed by the
model's own constructor, so they are exactly what an ordinary ``from_pretrained`` computes.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

_PATCH_LOCK = threading.Lock()


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While constructing, move each parameter to meta as it is registered; buffers stay put.

    This swaps ``nn.Module.register_parameter`` for the duration of the block only (the same
    technique accelerate's ``init_empty_weights`` uses); no model class is touched.
    """
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    with _PATCH_LOCK:
        torch.nn.Module.register_parameter = register
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = original


def model_class(config: PretrainedConfig) -> type:
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM


def build_skeleton(config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The model for ``config`` with parameters on meta (dtype ``dtype``) and real buffers."""
    cls = model_class(config)
    with _parameters_on_meta():
        if cls is AutoModelForCausalLM:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = cls._from_config(config, dtype=dtype)
    return model.eval()


class KeyMap:
    """Checkpoint key -> model key, by transformers' own rules for this model (``rename_source_key``
    with the model's renamings and weight converters, the base-model prefix added or dropped as
    the model's state dict needs), as ``from_pretrained`` maps them.

    ``map(key)`` gives (model key, converter source pattern or None); a key a converter takes is
    mapped to the converter's target, whose tensors ``loader.convert`` computes from every source
    of the group. ``renamed(key)`` applies the renamings alone (per-expert keys keep their index).
    """

    def __init__(self, model: torch.nn.Module):
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, rename_source_key
        except ImportError:  # a transformers without conversion mappings renames nothing
            get_model_conversion_mapping, WeightConverter, rename_source_key = (lambda m: []), (), None
        transforms = get_model_conversion_mapping(model) or []
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        self._rename = rename_source_key
        self._prefix = getattr(model, "base_model_prefix", None) or None
        self._targets = dict.fromkeys(model.state_dict())
        self._by_pattern = {p: c for c in self.converters for p in c.source_patterns}

    def _apply(self, key: str, converters: list) -> tuple[str, str | None]:
        if self._rename is None:
            return key, None
        new, pattern = self._rename(key, self.renamings, converters, self._prefix, self._targets)
        if new not in self._targets and key in self._targets:  # transformers' rule: a model key renamed away stays
            return key, None
        return new, pattern

    def map(self, key: str) -> tuple[str, str | None]:
        return self._apply(key, self.converters)

    def renamed(self, key: str) -> str:
        return self._apply(key, [])[0]

    def converter(self, pattern: str):
        """A fresh copy of the converter that matched ``pattern`` (each group collects its own tensors)."""
        return copy.deepcopy(self._by_pattern[pattern])
