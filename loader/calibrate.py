"""Calibration for pack: what a calibration text makes the experts see, and each expert's Hessians for int4's GPTQ.

Owns the two passes a calibrated pack makes over the source's experts (each source expert is read
once per pass):

- pass 1 (``record``), before any expert is written: the model built from the skeleton on the pack
  device with the source's dense weights, the experts modules materialized one layer at a time (a
  forward pre-hook reads that layer's experts in bf16, a forward hook frees them), runs the
  calibration windows once, without grad, one batched forward of ``batch`` windows at a time
  (``None``: all of them in one, so each expert is read once); each MoE layer's experts-module
  inputs (the hidden states and the top-k expert indices it receives) are appended to one file per
  layer in ``folder`` (the pack's temporary directory; removed with it);
- pass 2 (``Recorded.layer(...).hessians``), as pack writes the experts: for each expert, from the
  rows routed to it, ``X^T X`` of the fused gate/up (or up) input and, through the module's own
  activation (``_apply_gate``, or ``act_fn`` for a module without a gate), of down's input; the
  int4 encoder rounds each weight with GPTQ for its Hessian (``quant.gptq``), other precisions
  ignore them. An expert no calibration token reached has none, and gets the plain int4 fit
  (``Recorded.uncalibrated`` counts them).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import quant
from .layout import ExpertLayout, find_experts_modules
from .skeleton import build_skeleton
from .text import eval_windows, has_tokenizer, read_tokens

DEFAULT_WINDOWS = 64
DEFAULT_LENGTH = 512


@dataclass(frozen=True)
class CalibrationText:
    """The calibration windows, and what the manifest records of them."""

    file: Path
    windows: torch.Tensor  # [W, L] token ids

    @property
    def tokens(self) -> int:
        return self.windows.numel()

    def doc(self) -> dict:
        return {"file": self.file.name, "tokens": self.tokens, "windows": list(self.windows.shape)}


def check_calibrated(path: str | Path | None, precisions: Iterable[str]) -> None:
    """A ValueError when a calibration text ``path`` is given and none of ``precisions`` takes a Hessian
    (int4): it would change nothing."""
    precisions = list(precisions)
    if path is not None and not any(getattr(quant.get_scheme(p), "takes_hessian", False) for p in precisions):
        raise ValueError(f"calibration {str(path)!r}: only int4 is calibrated, and the precisions packed are "
                         f"{', '.join(precisions)}; add int4 or leave out the calibration text")


def calibration_text(path: str | Path | None, precisions: Iterable[str], src: Path, config, *, windows: int = DEFAULT_WINDOWS,
                     length: int = DEFAULT_LENGTH) -> CalibrationText | None:
    """``windows`` windows of ``length`` tokens of the text ``path`` (``loader.text``; None for none) for
    the source checkpoint ``src`` (its ``config``): tokenized by its tokenizer, else as bytes for a
    vocabulary of 256. A ValueError when no precision packed takes a Hessian (``check_calibrated``), when the text
    is shorter than one window, or when it cannot be tokenized (each naming the file)."""
    if path is None:
        return None
    check_calibrated(path, precisions)
    if windows < 1 or length < 2:
        raise ValueError(f"calibration {str(path)!r}: {windows} windows of {length} tokens; expected at least 1 window of 2 tokens")
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(positions, int) and length > positions:
        raise ValueError(f"calibration {str(path)!r}: windows of {length} tokens, longer than the model's {positions} positions "
                         f"(max_position_embeddings); give a shorter calibration length")
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    text = read_tokens(path, vocab, src, tokenizer=has_tokenizer(src))
    if text.ids.numel() < length:
        raise ValueError(f"calibration {str(path)!r}: {text.ids.numel()} {text.unit}s, shorter than one window of {length}")
    return CalibrationText(Path(path), eval_windows(text.ids, windows, length))


@dataclass(frozen=True)
class LayerExperts:
    """Where one MoE layer's experts come from, for pass 1."""

    layout: ExpertLayout
    read: Callable[[int], dict[str, torch.Tensor]]  # expert -> its tensors


def _set(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    """Parameter or buffer ``key`` of ``model`` replaced by ``value`` (in the dtype the skeleton gave it)."""
    mod_name, _, leaf = key.rpartition(".")
    mod = model.get_submodule(mod_name)
    old = getattr(mod, leaf)
    value = value.to(dtype=old.dtype)
    if leaf in mod._parameters:
        mod._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


def _dense_model(config, dense_units, device: torch.device) -> torch.nn.Module:
    """The skeleton of ``config`` on ``device`` with every dense weight the source gives (``dense_units``,
    ``loader.pack._dense_units``) and its tied weights tied; the experts' stay on meta."""
    model = build_skeleton(config)
    for _, read in dense_units:
        for key, t in read().items():
            _set(model, key, t.to(device))
    for name, buf in list(model.named_buffers()):
        _set(model, name, buf.to(device))
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if not tied and getattr(config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
    for target, source in dict(tied).items():
        if model.get_parameter(target).is_meta:
            _set(model, target, model.get_parameter(source))
    return model


@dataclass
class _Recorder:
    """Pass 1's hooks on one experts module: its experts in on the way in, out on the way out, its inputs appended to ``file``."""

    layer: LayerExperts
    file: Path
    device: torch.device
    meta: dict = field(default_factory=dict)
    top_k: int = 0  # indices a row holds, seen on the first call

    def pre(self, module, args, kwargs) -> None:
        experts = [self.layer.read(e) for e in range(self.layer.layout.num_experts)]
        for t in self.layer.layout.tensors:
            self.meta[t.name] = getattr(module, t.name)
            stacked = torch.stack([x[t.name] for x in experts]).to(self.device, torch.bfloat16)  # [E, ...]
            module._parameters[t.name] = torch.nn.Parameter(stacked, requires_grad=False)
        hidden = args[0] if args else kwargs["hidden_states"]  # [T, H]
        index = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if k in ("top_k_index", "router_indices"))  # [T, k]
        self.top_k = index.shape[1]
        rows = torch.cat([hidden.detach().to(torch.bfloat16).view(torch.uint8), index.to(torch.int32).view(torch.uint8)], dim=1)
        with open(self.file, "ab") as f:
            f.write(memoryview(rows.cpu().contiguous().numpy()))  # [T, 2H + 4k] bytes a row

    def post(self, module, args, kwargs, output) -> None:
        for name, p in self.meta.items():
            module._parameters[name] = p  # the meta parameter back: the layer's experts freed
        self.meta.clear()


@torch.no_grad()
def record(text: CalibrationText, config, dense_units, layers: dict[int, LayerExperts], folder: Path, device: torch.device,
           batch: int | None = None) -> Recorded:
    """Pass 1 (see the module docstring): the calibration windows through the model, each MoE layer's
    experts-module inputs into ``folder/layer-LLLL.bin``."""
    folder.mkdir()
    model = _dense_model(config, dense_units, device)
    handles, recorders = [], {}
    for L, (_, module) in find_experts_modules(model).items():
        rec = recorders[L] = _Recorder(layers[L], folder / f"layer-{L:04d}.bin", device)
        handles += [module.register_forward_pre_hook(rec.pre, with_kwargs=True),
                    module.register_forward_hook(rec.post, with_kwargs=True)]
    try:
        ids = text.windows  # [W, L]
        step = batch or ids.shape[0]
        for i in range(0, ids.shape[0], step):
            model(ids[i:i + step].to(device), use_cache=False, logits_to_keep=1)  # the experts' inputs matter, not the logits
    finally:
        for h in handles:
            h.remove()
    hidden = config.get_text_config().hidden_size
    return Recorded({L: (r.file, 2 * hidden + 4 * r.top_k) for L, r in recorders.items()}, hidden, device)


class Recorded:
    """The experts' inputs pass 1 recorded, per MoE layer; ``layer`` gives pass 2 their Hessians."""

    def __init__(self, files: dict[int, tuple[Path, int]], hidden: int, device: torch.device):
        self.files, self.hidden, self.device = files, hidden, device  # layer -> (file, bytes a row)
        self.uncalibrated = 0  # experts no calibration token reached (plain int4 fit)

    def layer(self, layer: int, module: torch.nn.Module, layout: ExpertLayout) -> LayerInputs:
        """Layer ``layer``'s recorded inputs, on the pack device (``module``: its experts module, whose
        activation pass 2 runs)."""
        path, width = self.files[layer]
        rows = torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(-1, width)  # [T, 2H + 4k]
        hidden = rows[:, :2 * self.hidden].contiguous().view(torch.bfloat16)  # [T, H]
        index = rows[:, 2 * self.hidden:].contiguous().view(torch.int32)  # [T, k]
        return LayerInputs(self, module, layout, hidden.to(self.device, torch.float32), index.to(self.device))


@dataclass
class LayerInputs:
    """One MoE layer's experts inputs: ``hidden`` float32 ``[T, H]``, ``index`` int32 ``[T, k]``."""

    recorded: Recorded
    module: torch.nn.Module
    layout: ExpertLayout
    hidden: torch.Tensor
    index: torch.Tensor

    def hessians(self, expert: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """``X^T X`` over the input axis of each weight of ``expert`` (``tensors``: its weights, as the
        module stores them) on the rows routed to it; None (and counted) when no row was."""
        x = self.hidden[(self.index == expert).any(dim=1)]  # [n, H]
        if x.shape[0] == 0:
            self.recorded.uncalibrated += 1
            return None
        m, lay = self.module, self.layout
        up = "gate_up_proj" if lay.has_gate else "up_proj"
        w = tensors[up].to(torch.float32)  # [2I, H], or [H, 2I] transposed
        h = x @ w if lay.is_transposed else x @ w.t()  # [n, 2I] (or [n, I] without a gate)
        if lay.has_bias:
            h = h + tensors[up + "_bias"].to(torch.float32)
        act = m._apply_gate(h) if lay.has_gate else m.act_fn(h)  # [n, I]
        return {up: x.t() @ x, "down_proj": act.t() @ act}  # [H, H], [I, I]
