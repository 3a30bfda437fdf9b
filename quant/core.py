"""Quantized-tensor type, field specs and the scheme registry.

Owns: the contract every scheme follows. A scheme turns one compute-dtype tensor into a
fixed set of named fields (declared up front by ``fields(shape)``), and turns those fields
back into the compute dtype with ``dequantize(q, out=)``. Schemes are pure functions of
their inputs; they know nothing of tiers, files or streams.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class FieldSpec:
    """One named tensor of an encoded weight: the unit a blob is laid out from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor in a scheme's transfer form: ``data`` holds exactly the fields the scheme declares."""

    scheme: str
    shape: tuple[int, ...]
    data: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())


class Scheme(Protocol):
    """A quantization scheme: ``fields`` declares the encoding, the two functions convert."""

    name: str
    lossless: bool
    # True when ``dequantize`` also takes fields with leading batch dims (several experts stacked,
    # ``out`` stacked the same way) and gives each expert exactly what it would alone
    stacks: bool

    def fields(self, shape: tuple[int, ...]) -> tuple[FieldSpec, ...]: ...

    def quantize(self, weight: torch.Tensor) -> QuantizedTensor: ...

    def dequantize(self, q: QuantizedTensor, *, out: torch.Tensor) -> torch.Tensor: ...

    def prepare(self, q: QuantizedTensor) -> QuantizedTensor:
        """``q`` in the form ``dequantize`` runs on with the fewest operations (views of the same
        memory): a caller that dequantizes fixed buffers again and again prepares them once."""
        ...


_REGISTRY: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
    _REGISTRY[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> Scheme:
    """The scheme called ``name``; a ValueError lists the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; known: {sorted(_REGISTRY)}") from None


def scheme_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor, *, chunk: int = 1 << 20) -> float:
    """Signal-to-quantization-noise ratio in dB, accumulated in float64 over chunks of ``chunk``
    elements (so a large weight never needs a full float64 copy); inf when exact."""
    ref = reference.detach().reshape(-1)
    app = approx.detach().reshape(-1)
    signal = noise = 0.0
    for i in range(0, ref.numel(), chunk):
        r = ref[i : i + chunk].to(torch.float64)
        signal += r.pow(2).sum().item()
        noise += r.sub_(app[i : i + chunk].to(torch.float64)).pow_(2).sum().item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
