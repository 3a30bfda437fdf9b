"""A model skeleton: the transformers model built from config.json with every parameter on
the meta device and every buffer real (on the CPU).

Owns: building that skeleton, and the renaming of checkpoint keys to the skeleton's own names.
Parameters cost nothing on meta; buffers (rotary tables and the like) are computed by the
model's own constructor, so they are exactly what an ordinary ``from_pretrained`` computes.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
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


def key_renamer(model: torch.nn.Module) -> Callable[[str], str]:
    """Checkpoint key -> model key, through transformers' own renaming rules for this model.

    Only plain renamings are applied here (``block_sparse_moe.`` -> ``mlp.`` and the like);
    expert tensors that transformers fuses with a converter are handled by the packer itself.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # a transformers without conversion mappings renames nothing
        return lambda key: key
    transforms = get_model_conversion_mapping(model) or []
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]

    def rename(key: str) -> str:
        for r in renamings:
            key, _ = r.rename_source_key(key)
        return key

    return rename
