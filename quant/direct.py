"""Direct reads: expert weights decoded on the GPU straight out of pinned host memory.

Owns: ``fetch``, one gather-and-decode over the picks of a layer call. For each pick ``j``, the
expert ``e = picks[j]`` is either resident (``resident[e]`` is its slot) or its encoding lies
in the byte buffer ``src`` at ``starts[e]``; a resident pick only reports its slot, any other
is decoded into slot ``dst[j]`` of every output slab. ``ids[j]`` receives the slot each pick's
weights are in, ``counts`` (int64 ``[2]``) grows by the resident and the decoded picks, and
``usage`` (int64 ``[E]``, optional) by one for each pick's expert.

On CUDA ``src`` is page-locked host memory and one Triton launch reads it over PCIe from the
SMs: no copy engine, no staging buffer, and no host sync, since the picks never leave the
device. Elsewhere (and without Triton) ``fetch_reference`` does the same with the schemes' own
torch operations, so the two agree bit for bit (the tests compare them). Supported encodings:
``bf16`` (a copy) and ``int8`` (per-row scale, ``q * s`` in fp32 rounded to bf16, as
``quant.int8`` computes it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quant.launch import kernel_module

# precision -> (the field holding the encoded data, the field of per-row scales or None)
FIELDS = {"bf16": ("data", None), "int8": ("qdata", "scale")}
BLOCK = 8192  # elements one program of the kernel decodes
MAX_BLOCKS = 65535  # programs per pick: the kernel's second grid dimension, as CUDA bounds it


@dataclass(frozen=True)
class DirectTensor:
    """One tensor of an expert: where its fields sit in a blob, and the slab it decodes into."""

    out: torch.Tensor  # [n_slots, *shape], bf16: slot i is row i
    data: int  # byte offset of the encoded data (bf16 values or int8 codes) within a blob
    scale: int | None  # byte offset of the fp32 per-row scales (int8), None for bf16


class DirectExpert(tuple):
    """An expert's ``DirectTensor``s, as ``fetch`` takes them; made once per slab and encoding
    and kept, it also carries the kernel's prepared launch (built at the first launch)."""

    launch_plan: object = None


def supported(precision: str) -> bool:
    return precision in FIELDS


def blocks(tensors: tuple[DirectTensor, ...]) -> int:
    """The kernel's programs per pick for an expert of ``tensors``: each tensor's elements in
    ``BLOCK``s, one after another."""
    return sum(math.ceil(math.prod(t.out.shape[1:]) / BLOCK) for t in tensors)


def fits(tensors: tuple[DirectTensor, ...]) -> bool:
    """Whether one launch can decode an expert of ``tensors`` (at most ``MAX_BLOCKS`` programs
    per pick: 512 Mi elements)."""
    return blocks(tensors) <= MAX_BLOCKS


def kernel_available() -> bool:
    """True when the Triton kernel can run (CUDA and Triton present)."""
    return kernel_module("direct_kernel") is not None


def fetch(src: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
          ids: torch.Tensor, counts: torch.Tensor, tensors: tuple[DirectTensor, ...], usage: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. ``src``: uint8 ``[bytes]``; ``starts``: int64 ``[E]``; ``resident``:
    int32 ``[E]`` (-1: not resident); ``picks``: int64 ``[m]``; ``dst``: int32 ``[m]``; ``ids``:
    int64 ``[m]``, written. Runs the kernel when the slabs are on CUDA, else the reference."""
    if not 1 <= len(tensors) <= 3:
        raise ValueError(f"direct fetch: an expert of 1 to 3 tensors, got {len(tensors)}")
    if tensors[0].out.device.type == "cuda" and kernel_available():
        from quant.direct_kernel import launch

        launch(src, starts, resident, picks, dst, ids, counts, tensors, usage)
        return ids
    return fetch_reference(src, starts, resident, picks, dst, ids, counts, tensors, usage)


def fetch_reference(src: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
                    ids: torch.Tensor, counts: torch.Tensor, tensors: tuple[DirectTensor, ...],
                    usage: torch.Tensor | None = None) -> torch.Tensor:
    """``fetch`` with torch operations, one pick at a time (brings the picks to the host)."""
    res, st, slots_out = resident.tolist(), starts.tolist(), []
    hits = 0
    for j, e in enumerate(picks.tolist()):
        if usage is not None:
            usage[e] += 1
        if res[e] >= 0:
            slots_out.append(res[e])
            hits += 1
            continue
        slot = int(dst[j])
        slots_out.append(slot)
        for t in tensors:
            shape = tuple(t.out.shape[1:])
            n = math.prod(shape)
            at = st[e] + t.data
            if t.scale is None:
                t.out[slot].copy_(src[at : at + 2 * n].view(torch.bfloat16).view(shape).to(t.out.device))
            else:
                q = src[at : at + n].view(torch.int8).view(shape).to(t.out.device)
                s_at = st[e] + t.scale
                s = src[s_at : s_at + 4 * (n // shape[-1])].view(torch.float32).view(*shape[:-1], 1).to(t.out.device)
                torch.mul(q, s, out=t.out[slot])
    ids.copy_(torch.tensor(slots_out, dtype=ids.dtype))
    counts += torch.tensor([hits, len(slots_out) - hits], dtype=counts.dtype, device=counts.device)
    return ids
