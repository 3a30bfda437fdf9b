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
``bf16`` (a copy) and ``int8`` (per-row or per-column scale, ``q * s`` in fp32 rounded to bf16,
as ``quant.int8`` computes it; its exact tensors, biases, are bf16 copies), and the 4-bit ones,
``int4``, ``nf4`` and ``mxfp4``, each as its scheme dequantizes it (``quant.direct4_kernel``
on CUDA). One launch decodes up to three tensors of one encoding; an expert of more, or of mixed
encodings (an INT8 expert with biases), is decoded by one launch per group of them
(``DirectExpert.groups``).

Two sources: ``starts[e] >= 0`` is a byte offset into ``src``; ``starts[e] < 0`` one into
``dev`` (``-1 - starts[e]``), the GPU's blob pool of quantized hot experts, whose ``resident``
entry is ``QUANTIZED_HOT`` (-2): a decode from it, counted apart by ``plan``, moves no bytes
between tiers. Without ``dev``, every start is into ``src``.

Also ``fetch_cached``: the same over a ``SlotCache``, slots that keep what they decoded across
calls. ``plan`` decides each pick's slot on the device (one program, the picks in order): a
resident pick reports its slot, a pick whose expert a cache slot holds reports that slot, and
any other takes a victim slot, which ``fetch_planned`` then decodes into. Victim rule, for calls
that visit the rows of a grid of layers in order and cyclically (a decode step): an empty slot,
else the slot whose expert's row comes back last after this call's row, least recently used
among those; never a slot an earlier pick of the same call uses. That is Belady's choice among
the held experts when each row is visited once per cycle (a held expert is next wanted no
sooner than its row's next visit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .launch import kernel_module

# precision -> (the field holding the encoded data, the field of per-row scales or None)
FIELDS = {"bf16": ("data", None), "int8": ("qdata", "scale")}
FOUR_BIT = ("int4", "nf4", "mxfp4")  # decoded from their own fields (``four_bit``)
QUANTIZED_HOT = -2  # ``resident`` of an expert whose blob is in ``dev`` (not a slot, not the host pool)
BLOCK = 8192  # elements one program of the kernel decodes
TILE_R, TILE_C = 8, 2048  # rows and codes of a row one program of the 4-bit kernel decodes (experiments/results/direct4_rate-wide.json)
MAX_BLOCKS = 65535  # programs per pick: the kernel's second grid dimension, as CUDA bounds it


@dataclass(frozen=True)
class DirectTensor:
    """One tensor of an expert: where its fields sit in a blob, and the slab it decodes into."""

    out: torch.Tensor  # [n_slots, *shape], bf16: slot i is row i
    data: int  # byte offset of the encoded data (bf16 values, int8 or 4-bit codes) within a blob
    scale: int | None  # byte offset of the scales (int8's fp32, int4's scale codes, nf4's qabsmax, mxfp4's exponents), None for bf16
    cols: bool = False  # int8 scales per column (a weight stored [in, out]), else per row
    kind: str = ""  # a 4-bit precision (``FOUR_BIT``), or "" for bf16 and int8
    zero: int = 0  # 4-bit: byte offset of int4's zero points or nf4's absmax2
    extra: int = 0  # 4-bit: byte offset of int4's row scales or nf4's offset
    rows: int = 0  # 4-bit: the storage's rows (R) and codes a row (C) and the group size (G), quant.direct4_kernel
    cols_n: int = 0
    group: int = 0
    transposed: bool = False  # 4-bit: the slot holds the storage transposed ([C, R])
    fields: tuple = ()  # 4-bit: (name, dtype, shape, byte offset) of each field, for the reference

    @property
    def encoding(self) -> tuple:
        if self.kind:
            return (self.kind, self.transposed)
        return (self.scale is not None, self.cols)


class DirectExpert(tuple):
    """An expert's ``DirectTensor``s, as ``fetch`` takes them; made once per slab and encoding
    and kept, it also carries the kernel's prepared launch (built at the first launch)."""

    launch_plan: object = None
    _groups: tuple | None = None

    @property
    def groups(self) -> tuple[DirectExpert, ...]:
        """The tensors as the kernel's launches take them: those of one encoding together, at most
        three a launch (one group, ``self``, for an expert that one launch decodes)."""
        if self._groups is None:
            by: dict[tuple[bool, bool], list[list[DirectTensor]]] = {}
            for t in self:
                runs = by.setdefault(t.encoding, [[]])
                if len(runs[-1]) == 3:
                    runs.append([])
                runs[-1].append(t)
            runs = [r for rs in by.values() for r in rs]
            self._groups = (self,) if len(runs) == 1 else tuple(DirectExpert(r) for r in runs)
        return self._groups


def _groups(tensors: tuple[DirectTensor, ...]) -> tuple[tuple[DirectTensor, ...], ...]:
    return tensors.groups if isinstance(tensors, DirectExpert) else DirectExpert(tensors).groups


def supported(precision: str) -> bool:
    return precision in FIELDS or precision in FOUR_BIT


def four_bit(out: torch.Tensor, precision: str, fields: dict[str, tuple[torch.dtype, tuple[int, ...], int]]) -> DirectTensor:
    """How the 4-bit kernel reads one tensor of a ``precision`` blob into its slab ``out``
    (``[n_slots, *shape]``), from its fields (name -> (dtype, shape, byte offset))."""
    shape = tuple(out.shape[1:])
    placed = tuple((n, d, s, o) for n, (d, s, o) in fields.items())
    if precision == "int4":
        name = "codes_t" if "codes_t" in fields else "codes"
        rows, half = fields[name][1][-2:]
        groups = fields["scale"][1][-1]
        return DirectTensor(out, fields[name][2], fields["scale"][2], kind="int4", zero=fields["zero"][2], extra=fields["row_scale"][2],
                            rows=rows, cols_n=2 * half, group=2 * half // groups, transposed=name == "codes_t", fields=placed)
    if precision == "nf4":
        from .nf4 import BLOCK as NF4_BLOCK

        return DirectTensor(out, fields["codes"][2], fields["qabsmax"][2], kind="nf4", zero=fields["absmax2"][2],
                            extra=fields["offset"][2], rows=math.prod(shape[:-1]), cols_n=shape[-1], group=NF4_BLOCK, fields=placed)
    rows, groups, half = fields["blocks"][1][-3:]  # mxfp4: [N, K/32, 16], the slot [K, N]
    return DirectTensor(out, fields["blocks"][2], fields["scales"][2], kind="mxfp4", rows=rows, cols_n=groups * 2 * half,
                        group=2 * half, transposed=True, fields=placed)


def expert_of(slabs: dict[str, torch.Tensor], blob, precision: str) -> DirectExpert:
    """How ``fetch`` decodes a packed blob (its ``shapes`` and placed ``fields``, as ``loader.blob``
    lays them out) of ``precision`` into ``slabs``: one ``DirectTensor`` per tensor, in order."""
    return DirectExpert(placed(slabs[name], [f for f in blob.fields if f.tensor == name], precision) for name, _ in blob.shapes)


def placed(out: torch.Tensor, fields: list, precision: str) -> DirectTensor:
    """How ``quant.direct`` decodes one tensor's placed fields into its slab ``out``: int8 codes and
    their scales (per column where the scales run along the last axis), 4-bit fields, or a bf16
    copy (bf16 experts, and the tensors the lossy precisions keep exact: biases)."""
    by = {f.spec.name: f for f in fields}
    if precision in FOUR_BIT and "data" not in by:
        return four_bit(out, precision, {n: (f.spec.dtype, f.spec.shape, f.offset) for n, f in by.items()})
    if "qdata" not in by:
        return DirectTensor(out, by["data"].offset, None)
    scale = by["scale"].spec
    cols = len(scale.shape) == len(by["qdata"].spec.shape) and scale.shape[-2:-1] == (1,)
    return DirectTensor(out, by["qdata"].offset, by["scale"].offset, cols)


def blocks(tensors: tuple[DirectTensor, ...]) -> int:
    """The kernel's programs per pick for an expert of ``tensors``: each tensor's elements in
    ``BLOCK``s (4-bit ones: tiles of ``TILE_R`` x ``TILE_C``), one after another."""
    return sum(math.ceil(t.rows / TILE_R) * math.ceil(t.cols_n / TILE_C) if t.kind else math.ceil(math.prod(t.out.shape[1:]) / BLOCK)
               for t in tensors)


def fits(tensors: tuple[DirectTensor, ...]) -> bool:
    """Whether one launch can decode an expert of ``tensors`` (at most ``MAX_BLOCKS`` programs
    per pick: 512 Mi elements)."""
    return blocks(tensors) <= MAX_BLOCKS


def kernel_available() -> bool:
    """True when the Triton kernel can run (CUDA and Triton present)."""
    return kernel_module("direct_kernel") is not None


def fetch(src: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
          ids: torch.Tensor, counts: torch.Tensor, tensors: tuple[DirectTensor, ...], usage: torch.Tensor | None = None,
          dev: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. ``src``: uint8 ``[bytes]``; ``starts``: int64 ``[E]``; ``resident``:
    int32 ``[E]`` (-1: not resident); ``picks``: int64 ``[m]``; ``dst``: int32 ``[m]``; ``ids``:
    int64 ``[m]``, written; ``dev``: the second source (negative starts). Runs the kernel when the
    slabs are on CUDA, else the reference."""
    if not tensors:
        raise ValueError("direct fetch: an expert of no tensors")
    if tensors[0].out.device.type == "cuda" and kernel_available():
        first, *rest = _groups(tensors)
        dev = src if dev is None else dev
        _kernel(first).launch(src, dev, starts, resident, picks, dst, ids, counts, first, usage)
        if rest:  # the other groups decode the same picks: the non-resident ones, into dst
            m = picks.numel()
            planned = torch.where(resident[picks] >= 0, -1, dst[:m].to(picks.device, torch.int32, non_blocking=True))  # [m]
            for g in rest:
                _kernel(g).launch_planned(src, dev, starts, picks, planned, g)
        return ids
    return fetch_reference(src, starts, resident, picks, dst, ids, counts, tensors, usage, dev)


def fetch_reference(src: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
                    ids: torch.Tensor, counts: torch.Tensor, tensors: tuple[DirectTensor, ...],
                    usage: torch.Tensor | None = None, dev: torch.Tensor | None = None) -> torch.Tensor:
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
        _decode_into(src, dev, st[e], slot, tensors)
    ids.copy_(torch.tensor(slots_out, dtype=ids.dtype))
    counts += torch.tensor([hits, len(slots_out) - hits], dtype=counts.dtype, device=counts.device)
    return ids


@dataclass(frozen=True)
class SlotCache:
    """Slots of the output slabs that keep what they decoded across ``fetch_cached`` calls.
    Experts are named by cell, ``row * width + expert``, of a grid whose rows the calls visit in
    order, cyclically. Every tensor lives on the slabs' device and is allocated once, so a CUDA
    graph of a call keeps reading and writing the same memory."""

    slots: torch.Tensor  # int32 [R]: the slab rows the cache owns
    owner: torch.Tensor  # int64 [R]: the cell each slot holds, -1 for none
    stamp: torch.Tensor  # int64 [R]: the clock at each slot's last use
    clock: torch.Tensor  # int64 [1]: picks planned so far
    dst: torch.Tensor  # int32 [R]: per pick of the last call, the slot it decodes into, -1 for none
    rows: int
    width: int

    @classmethod
    def new(cls, slots: list[int], rows: int, width: int, device: torch.device | str) -> SlotCache:
        if not slots:
            raise ValueError("a slot cache needs at least one slot")
        r = len(slots)
        return cls(torch.tensor(slots, dtype=torch.int32, device=device), torch.full((r,), -1, dtype=torch.int64, device=device),
                   torch.zeros(r, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device),
                   torch.full((r,), -1, dtype=torch.int32, device=device), rows, width)

    def clear(self) -> None:
        """Forget every slot's expert (queued on the current stream)."""
        self.owner.fill_(-1)
        self.stamp.zero_()
        self.clock.zero_()


def plan(cache: SlotCache, row: int, resident: torch.Tensor, picks: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
         usage: torch.Tensor | None = None) -> None:
    """See the module docstring: ``ids[j]`` receives pick ``j``'s slot, ``cache.dst[j]`` the slot
    it decodes into (-1: it reads a resident or cached slot); ``counts`` (int64 ``[3]``, or ``[4]``) grows by
    the resident, the decoded and the cached picks (and, with 4, the decoded ones whose
    ``resident`` is ``QUANTIZED_HOT``: read from ``dev``). ``resident``: int32 ``[E]`` of row
    ``row`` (-1: not resident); ``picks``: int64 ``[m]``, at most as many as the cache's slots."""
    m, r = picks.numel(), cache.slots.numel()
    if m > r:
        raise ValueError(f"direct plan: {m} picks, more than the cache's {r} slots")
    if not 0 <= row < cache.rows:
        raise ValueError(f"direct plan: row {row} outside the cache's {cache.rows} rows")
    if cache.slots.device.type == "cuda" and kernel_available():
        from .direct_kernel import launch_plan

        launch_plan(cache, row, resident, picks, ids, counts, usage)
        return
    plan_reference(cache, row, resident, picks, ids, counts, usage)


def _victim(owner: list[int], stamp: list[int], used: set[int], row: int, rows: int, width: int) -> int:
    """The cache lane a miss takes (the module docstring's rule): an empty one, else the one whose
    row comes back last after ``row``, then the least recently used, then the first."""
    def key(i: int) -> tuple[int, int, int]:
        back = rows + 1 if owner[i] < 0 else (owner[i] // width - row - 1) % rows + 1
        return (-back, stamp[i], i)
    return min((i for i in range(len(owner)) if i not in used), key=key)


def plan_reference(cache: SlotCache, row: int, resident: torch.Tensor, picks: torch.Tensor, ids: torch.Tensor,
                   counts: torch.Tensor, usage: torch.Tensor | None = None) -> None:
    """``plan`` on the host, one pick at a time (brings the cache and the picks to the host)."""
    owner, stamp, slots = cache.owner.tolist(), cache.stamp.tolist(), cache.slots.tolist()
    now = int(cache.clock[0])
    res = resident.tolist()
    out_ids, out_dst, used, n = [], [-1] * len(slots), set(), [0, 0, 0, 0]
    for j, e in enumerate(picks.tolist()):
        cell = row * cache.width + e
        if usage is not None:
            usage[e] += 1
        if res[e] >= 0:
            out_ids.append(res[e])
            n[0] += 1
        else:
            if cell in owner:
                i = owner.index(cell)
                n[2] += 1
            else:
                i = _victim(owner, stamp, used, row, cache.rows, cache.width)
                owner[i] = cell
                out_dst[j] = slots[i]
                n[1] += 1
                n[3] += res[e] == QUANTIZED_HOT
            stamp[i] = now
            used.add(i)
            out_ids.append(slots[i])
        now += 1
    dev = cache.owner.device
    cache.owner.copy_(torch.tensor(owner, dtype=torch.int64, device=dev))
    cache.stamp.copy_(torch.tensor(stamp, dtype=torch.int64, device=dev))
    cache.clock.fill_(now)
    cache.dst.copy_(torch.tensor(out_dst, dtype=torch.int32, device=dev))
    ids.copy_(torch.tensor(out_ids, dtype=ids.dtype))
    counts += torch.tensor(n[: counts.numel()], dtype=counts.dtype, device=counts.device)


def fetch_planned(src: torch.Tensor, starts: torch.Tensor, picks: torch.Tensor, dst: torch.Tensor,
                  tensors: tuple[DirectTensor, ...], dev: torch.Tensor | None = None) -> None:
    """Decode pick ``j``'s expert (``starts[picks[j]]`` in ``src``, or in ``dev`` where negative)
    into slot ``dst[j]`` of every output slab, for each ``j`` with ``dst[j] >= 0`` (``dst`` as
    ``plan`` leaves it)."""
    if not tensors:
        raise ValueError("direct fetch: an expert of no tensors")
    if tensors[0].out.device.type == "cuda" and kernel_available():
        for g in _groups(tensors):
            _kernel(g).launch_planned(src, src if dev is None else dev, starts, picks, dst, g)
        return
    st = starts.tolist()
    for e, slot in zip(picks.tolist(), dst[: picks.numel()].tolist()):
        if slot >= 0:
            _decode_into(src, dev, st[e], slot, tensors)


def _kernel(tensors):
    """The kernel module that decodes a group of ``tensors`` (one encoding)."""
    if tensors[0].kind:
        from . import direct4_kernel

        return direct4_kernel
    from . import direct_kernel

    return direct_kernel


def four_bit_fields(buf: torch.Tensor, start: int, t: DirectTensor) -> dict[str, torch.Tensor]:
    """The fields of 4-bit tensor ``t`` of the blob at byte ``start`` of ``buf``, as views, on ``t``'s slab's device."""
    return {name: buf[start + o : start + o + math.prod(s) * d.itemsize].view(d).view(s).to(t.out.device) for name, d, s, o in t.fields}


def _decode_into(src: torch.Tensor, dev: torch.Tensor | None, start: int, slot: int, tensors: tuple[DirectTensor, ...]) -> None:
    """The reference's decode of the expert at byte ``start`` of ``src`` (negative: ``-1 - start``
    of ``dev``) into ``slot`` of every slab."""
    if start < 0:
        src, start = dev, -1 - start
    from . import get_scheme
    from .core import QuantizedTensor

    for t in tensors:
        shape = tuple(t.out.shape[1:])
        n = math.prod(shape)
        at = start + t.data
        if t.kind:  # the scheme's own dequantization of views of the blob's fields
            get_scheme(t.kind).dequantize(QuantizedTensor(t.kind, shape, four_bit_fields(src, start, t)), out=t.out[slot])
        elif t.scale is None:
            t.out[slot].copy_(src[at : at + 2 * n].view(torch.bfloat16).view(shape).to(t.out.device))
        else:
            q = src[at : at + n].view(torch.int8).view(shape).to(t.out.device)
            s_at = start + t.scale
            s_shape = (*shape[:-2], 1, shape[-1]) if t.cols else (*shape[:-1], 1)
            s = src[s_at : s_at + 4 * math.prod(s_shape)].view(torch.float32).view(s_shape).to(t.out.device)
            torch.mul(q, s, out=t.out[slot])


def fetch_cached(src: torch.Tensor, starts: torch.Tensor, resident: torch.Tensor, picks: torch.Tensor, cache: SlotCache,
                 row: int, ids: torch.Tensor, counts: torch.Tensor, tensors: tuple[DirectTensor, ...],
                 usage: torch.Tensor | None = None, dev: torch.Tensor | None = None) -> torch.Tensor:
    """``plan`` then ``fetch_planned``: every pick's slot in ``ids``, each miss decoded into a
    cache slot that keeps it for later calls. Two launches on CUDA, no host sync."""
    plan(cache, row, resident, picks, ids, counts, usage)
    fetch_planned(src, starts, picks, cache.dst, tensors, dev)
    return ids
