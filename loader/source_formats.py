"""Quantized source formats read as plain tensors: MXFP4 ``*_blocks``/``*_scales`` and FP8 ``weight``/``weight_scale_inv`` pairs.

Owns: finding the pairs among a checkpoint's tensor names (checked against their headers:
dtypes, shapes, the FP8 block size of config.json's ``quantization_config``), and reading
each pair, through a shard handle, as one bf16 tensor under its plain name:

- MXFP4 (gpt-oss's experts): ``X_blocks`` uint8 ``[E, N, G, 16]`` + ``X_scales`` uint8 ``[E, N, G]``
  -> ``X`` ``[E, G*32, N]``, the experts module's transposed layout (``quant.mxfp4``); other
  ranks are refused, since only fused experts tensors are known to take that layout;
- block-scaled FP8 (DeepSeek-V3): ``X.weight`` float8_e4m3fn + ``X.weight_scale_inv`` fp32
  -> ``X.weight`` (``quant.fp8``).

The plain names replace the parts' names in the checkpoint's key list, so every reader of the
source (pack's plan, dense shards, experts) sees ordinary bf16 tensors. A slice ``[i]`` of a
fused pair reads and decodes only that slice of both parts: each expert is decoded once, when
it is read, and nothing larger than one tensor (or one expert's slice) is ever decoded.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quant import fp8, mxfp4

MXFP4, FP8 = "mxfp4", "fp8"


@dataclass(frozen=True)
class Pair:
    """One quantized tensor: its format, its two parts' names and shards, and its plain shape."""

    format: str
    parts: tuple[str, str]  # (blocks, scales) or (weight, weight_scale_inv)
    files: tuple[str, str]
    shape: tuple[int, ...]
    block: tuple[int, int] | None = None  # FP8's block size

    def decode(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        if self.format == FP8:
            return fp8.decode(first, second, self.block)
        if bool((second == mxfp4.NAN_SCALE).any()):
            raise ValueError(f"MXFP4 scales {self.parts[1]!r} in {self.files[1]!r} hold the byte 255, which E8M0 reserves for NaN")
        return mxfp4.decode(first, second)


class SourceFormats:
    """The quantized pairs of one checkpoint, by plain name."""

    def __init__(self, root: Path, pairs: dict[str, Pair]):
        self.root, self.pairs = root, pairs

    @property
    def formats(self) -> set[str]:
        return {p.format for p in self.pairs.values()}

    def handle(self, f, fname: str) -> _Handle:
        return _Handle(self, f, fname)


class _Handle:
    """A ``safe_open`` handle on which the pairs read decoded under their plain names; any other name reads as stored."""

    def __init__(self, formats: SourceFormats, f, fname: str):
        self.formats, self.raw, self.fname = formats, f, fname

    def keys(self):
        return self.raw.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        pair = self.formats.pairs.get(key)
        if pair is None:
            return self.raw.get_tensor(key)
        return pair.decode(*(self._read(part, file, None) for part, file in zip(pair.parts, pair.files)))

    def get_slice(self, key: str):
        pair = self.formats.pairs.get(key)
        return self.raw.get_slice(key) if pair is None else _Slice(self, pair)

    def _read(self, part: str, file: str, index) -> torch.Tensor:
        """Part ``part`` (or its slice ``[index]``) as stored, from this shard or, opened for the read, its own."""
        if file == self.fname:
            return self.raw.get_tensor(part) if index is None else self.raw.get_slice(part)[index]
        from safetensors import safe_open

        with safe_open(self.formats.root / file, framework="pt") as g:
            return g.get_tensor(part) if index is None else g.get_slice(part)[index]


class _Slice:
    """A pair as ``safe_open``'s ``get_slice`` gives a tensor: dtype and shape without reading, ``[i]`` reading one slice."""

    def __init__(self, handle: _Handle, pair: Pair):
        self.handle, self.pair = handle, pair

    def get_dtype(self) -> str:
        return "BF16"

    def get_shape(self) -> list[int]:
        return list(self.pair.shape)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not isinstance(index, int) or len(self.pair.shape) < 3:  # pack slices fused tensors only
            raise TypeError(f"{self.pair.format} tensor {self.pair.parts[0]!r}: only one expert's slice [int] of a fused tensor reads decoded")
        p = self.pair
        return p.decode(*(self.handle._read(part, file, index) for part, file in zip(p.parts, p.files)))


def read(root: Path, key_to_file: dict[str, str], open_shard: Callable) -> tuple[dict[str, str], SourceFormats]:
    """(the key list with each pair under its plain name, the pairs): ``key_to_file`` maps the
    checkpoint's tensor names to shards; ``open_shard(fname)`` opens one (a context manager).
    A pair whose parts' dtypes or shapes disagree is a ValueError naming the parts and shard."""
    pairs: dict[str, tuple[str, str, str]] = {}  # plain -> (format, first, second)
    for key in key_to_file:
        if key.endswith("_blocks") and key.removesuffix("_blocks") + "_scales" in key_to_file:
            plain = key.removesuffix("_blocks")
            pairs[plain] = (MXFP4, key, plain + "_scales")
        elif key.endswith(".weight_scale_inv") and key.removesuffix("_scale_inv") in key_to_file:
            plain = key.removesuffix("_scale_inv")
            pairs[plain] = (FP8, plain, key)
    if not pairs:
        return key_to_file, SourceFormats(root, {})
    block = _fp8_block(root) if any(f == FP8 for f, _, _ in pairs.values()) else None
    metas = _metas(key_to_file, {k for _, a, b in pairs.values() for k in (a, b)}, open_shard)
    checked = {plain: _check(fmt, a, b, key_to_file, metas, block) for plain, (fmt, a, b) in pairs.items()}
    parts = {k for p in checked.values() for k in p.parts}
    out = {k: f for k, f in key_to_file.items() if k not in parts}
    out.update({plain: p.files[0] for plain, p in checked.items()})
    return out, SourceFormats(root, checked)


def _fp8_block(root: Path) -> tuple[int, int]:
    """config.json's ``quantization_config.weight_block_size`` (128 x 128 when it names none)."""
    try:
        qc = json.loads((root / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return fp8.DEFAULT_BLOCK  # config.json's own errors are reported by whoever parses it
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if block is None:
        return fp8.DEFAULT_BLOCK
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ValueError(f"{str(root / 'config.json')!r}: quantization_config.weight_block_size {block!r} is not two positive integers")
    return (block[0], block[1])


def _metas(key_to_file: dict[str, str], keys: set[str], open_shard: Callable) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of ``keys`` from their shards' headers, each shard opened once."""
    by_file: dict[str, list[str]] = {}
    for k in sorted(keys):
        by_file.setdefault(key_to_file[k], []).append(k)
    out = {}
    for fname, names in by_file.items():
        with open_shard(fname) as f:
            for k in names:
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def _check(fmt: str, first: str, second: str, key_to_file, metas, block) -> Pair:
    (d1, s1), (d2, s2) = metas[first], metas[second]
    files = (key_to_file[first], key_to_file[second])
    where = f"{first!r} ({d1} {list(s1)}, in {files[0]!r}) and {second!r} ({d2} {list(s2)}, in {files[1]!r})"
    if fmt == MXFP4:
        if d1 != "U8" or d2 != "U8" or len(s1) < 4 or s1[-1] != mxfp4.BLOCK // 2 or s1[:-1] != s2:
            raise ValueError(f"MXFP4 pair {where}: expected a fused experts tensor's uint8 blocks [E, N, G, 16] and uint8 "
                             f"scales [E, N, G]")
        *lead, n, g, _ = s1
        return Pair(MXFP4, (first, second), files, (*lead, g * mxfp4.BLOCK, n))
    if d1 != "F8_E4M3" or d2 != "F32" or len(s1) < 2 or s2 != fp8.grid(s1, block):
        raise ValueError(f"FP8 pair {where}: expected a float8_e4m3fn weight and fp32 weight_scale_inv of one entry per "
                         f"{block[0]}x{block[1]} block, {list(fp8.grid(s1, block)) if len(s1) >= 2 else '[..., gR, gC]'}")
    return Pair(FP8, (first, second), files, s1, block)


def check_precisions(precisions, source) -> None:
    """Refuse, before anything is written, a precision the source's format cannot give: ``mxfp4``
    keeps MXFP4 weights as stored, so it needs an MXFP4 checkpoint."""
    if MXFP4 in precisions and MXFP4 not in source.formats.formats:
        raise ValueError(
            f"precision 'mxfp4' keeps MXFP4 expert weights as the checkpoint stores them, and source checkpoint "
            f"{str(source.path)!r} stores none (no *_blocks with *_scales tensors); choose another precision (bf16, int8)"
        )
