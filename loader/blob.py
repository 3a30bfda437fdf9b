"""Blob layout: all tensors of one expert in one precision, packed into one contiguous buffer.

Owns: where each encoded field sits inside a blob, and the conversion between a blob's bytes
and the scheme's fields. Invariants: every field starts on a 256-byte boundary (so any dtype
view is aligned), and a blob's stride in a file is a multiple of 4 KiB, so one expert moves
with exactly one copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .. import quant
from .layout import ExpertLayout
from ..quant import FieldSpec, QuantizedTensor

FIELD_ALIGN = 256
BLOB_ALIGN = 4096

def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PlacedField:
    tensor: str
    spec: FieldSpec
    offset: int


@dataclass(frozen=True)
class BlobLayout:
    """Where every field of one expert's encoding lives inside its blob."""

    precision: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    fields: tuple[PlacedField, ...]
    nbytes: int
    transposed: bool = False  # the layout's weights are stored [in, out]: per-output-row scales run along columns
    options: tuple[tuple[str, int], ...] = ()  # the encoder's settings (int4's group size), as the manifest records them

    @cached_property
    def tensor_spans(self) -> tuple[tuple[str, int, int], ...]:
        """Each tensor's bytes in the blob, ``(name, lo, hi)`` in blob order: a tensor's fields are
        placed together, so one copy of ``[lo, hi)`` moves all of them."""
        spans = []
        for name, _ in self.shapes:
            placed = [f for f in self.fields if f.tensor == name]
            spans.append((name, min(f.offset for f in placed), max(f.offset + f.spec.nbytes for f in placed)))
        return tuple(sorted(spans, key=lambda s: s[1]))

    @property
    def stride(self) -> int:
        """Bytes a blob occupies in a file or pool: ``nbytes`` rounded up to 4 KiB."""
        return align(self.nbytes, BLOB_ALIGN)

    def encode(self, tensors: dict[str, torch.Tensor], hessians: dict[str, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
        """Quantize one expert's tensors into a fresh uint8 CPU blob of ``stride`` bytes; also the SQNR (dB)
        per tensor the encoding changed. Quantization runs on the tensors' device (a GPU makes large packs much faster).
        ``hessians``: a tensor's inputs' ``X^T X`` (``loader.calibrate``), which a scheme that takes one
        (int4: GPTQ) rounds for; other schemes ignore them."""
        scheme = quant.get_scheme(self.precision)
        blob = torch.zeros(self.stride, dtype=torch.uint8)  # [stride]
        sqnr: dict[str, float] = {}
        for name, shape in self.shapes:
            w = tensors[name]
            if tuple(w.shape) != shape:
                raise ValueError(f"expert tensor {name!r} has shape {tuple(w.shape)}, layout says {shape}")
            kw = _kwargs(scheme, self.transposed, shape, dict(self.options))
            if hessians and name in hessians and getattr(scheme, "takes_hessian", False):
                kw["hessian"] = hessians[name]
            q = scheme.quantize(w, **kw)
            for pf in self.fields:
                if pf.tensor == name:
                    src = q.data[pf.spec.name].contiguous().view(-1).view(torch.uint8)
                    blob[pf.offset : pf.offset + src.numel()].copy_(src)
            if not scheme.lossless:
                back = torch.empty(shape, dtype=torch.bfloat16, device=w.device)
                scheme.dequantize(q, out=back)
                db = quant.sqnr_db(w, back)
                if math.isfinite(db):  # an exact encoding (a bias int8 keeps, mxfp4 of an MXFP4 source) records none, as bf16 does
                    sqnr[name] = db
        return blob, sqnr

    def views(self, blob: torch.Tensor) -> dict[str, QuantizedTensor]:
        """Zero-copy views of a uint8 blob (on any device) as the scheme's fields. A 2-D ``blob``
        ``[n, bytes]`` (rows of equal layout, each row's stride a multiple of 256) gives fields
        stacked ``[n, *shape]``, for schemes that dequantize several experts at once."""
        lead = tuple(blob.shape[:-1])
        data: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _ in self.shapes}
        for pf in self.fields:
            raw = blob[..., pf.offset : pf.offset + pf.spec.nbytes]
            data[pf.tensor][pf.spec.name] = raw.view(pf.spec.dtype).view(lead + pf.spec.shape)
        return {name: QuantizedTensor(self.precision, lead + shape, data[name]) for name, shape in self.shapes}

    def dequantize_into(self, blob: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """Decode a blob into the compute-dtype tensors ``out`` (slot memory), on the blob's device."""
        self.dequantize_views(self.views(blob), out)

    def dequantize_views(self, views: dict[str, QuantizedTensor], out: dict[str, torch.Tensor]) -> None:
        """``dequantize_into`` from views made once by ``views`` (a caller that reuses buffers keeps them)."""
        scheme = quant.get_scheme(self.precision)
        for name, q in views.items():
            scheme.dequantize(q, out=out[name])

    def to_json(self) -> dict:
        return {
            "precision": self.precision,
            **({"options": dict(self.options)} if self.options else {}),
            "nbytes": self.nbytes,
            "stride": self.stride,
            "fields": [
                {"tensor": f.tensor, "field": f.spec.name, "dtype": dtype_name(f.spec.dtype), "shape": list(f.spec.shape), "offset": f.offset}
                for f in self.fields
            ],
        }


def _kwargs(scheme, transposed: bool, shape: tuple[int, ...], options: dict) -> dict:
    """A scheme's keywords for one tensor: ``columns`` makes a scheme with per-output-row scales
    scale a transposed weight (``[in, out]``) per column; ``options`` are its settings."""
    kw = dict(options)
    if transposed and len(shape) >= 2 and getattr(scheme, "per_output_row", False):
        kw["columns"] = True
    return kw


def scheme_options(precision: str, options: dict | None) -> tuple[tuple[str, int], ...]:
    """The settings a precision's encoder takes among ``options`` (int4: ``group``), checked: a
    ValueError names the precision and the setting it does not take."""
    options = dict(options or {})
    takes_group = getattr(quant.get_scheme(precision), "takes_group", False)
    allowed = {"group"} if takes_group else set()
    for k, v in options.items():
        if k not in allowed:
            raise ValueError(f"precision {precision!r} takes no setting {k!r}" + (f"; it takes {sorted(allowed)}" if allowed else ""))
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"precision {precision!r}: setting {k!r} must be an integer, got {v!r}")
        if k == "group" and v < 2:  # here, before a pack reads anything, not from the first tensor's fields
            raise ValueError(f"precision {precision!r}: setting 'group' must be at least 2, got {v!r}")
    if takes_group:  # recorded even when not asked for, so that a load can check it
        options.setdefault("group", quant.get_scheme(precision).default_group)
    return tuple(sorted(options.items()))


def blob_layout(layout: ExpertLayout, precision: str, options: dict | None = None) -> BlobLayout:
    """Where each field of an expert of ``layout`` goes in a blob of ``precision``, its encoder
    set by ``options`` (``scheme_options``)."""
    scheme = quant.get_scheme(precision)
    opts = scheme_options(precision, options)
    placed: list[PlacedField] = []
    offset = 0
    for t in layout.tensors:
        for spec in scheme.fields(t.shape, **_kwargs(scheme, layout.is_transposed, t.shape, dict(opts))):
            offset = align(offset, FIELD_ALIGN)
            placed.append(PlacedField(t.name, spec, offset))
            offset += spec.nbytes
    shapes = tuple((t.name, t.shape) for t in layout.tensors)
    return BlobLayout(precision, shapes, tuple(placed), offset, layout.is_transposed, opts)
