"""Reading a text as a model's token ids, and taking evenly spaced windows of them.

Owns how a text file becomes token ids, for every tool that feeds a model text (tiers-quality's
evaluation text, pack's calibration text): token ids as ``.json`` (a list of ints) or ``.npy`` (a
1-D integer array); else UTF-8 text, tokenized by the model's tokenizer when its folder carries one
(no special tokens added), else, for a byte-level model (vocabulary 256), as its bytes. Every id is
checked against the vocabulary. Errors are ValueErrors naming the file.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class Text:
    """The tokens to measure over, and what a token is: ``byte`` for a byte-level model, else ``token``."""

    ids: torch.Tensor  # [n] int64
    unit: str
    source: str  # how the file was read: "utf-8 bytes", "tokenizer", ".json ids", ".npy ids"


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` (a checkpoint or a pack) carries a tokenizer's files."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def read_tokens(path: str | Path, vocab: int, model: str | Path, *, tokenizer: bool) -> Text:
    """The token ids of the file ``path`` for the model in the folder ``model`` (its vocabulary
    ``vocab``; ``tokenizer``: whether that folder carries a tokenizer, which then tokenizes text)."""
    path = str(path)
    unit = "token" if tokenizer or vocab != 256 else "byte"
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        ids, source = _json_ids(path), ".json ids"
    elif suffix == ".npy":
        ids, source = _npy_ids(path), ".npy ids"
    else:
        data = Path(path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); give UTF-8 text, "
                             f"or token ids as .json (a list of ints) or .npy (a 1-D integer array)") from None
        if tokenizer:
            ids, source = _tokenize(model, text), "tokenizer"
        elif vocab == 256:
            ids, source = torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), "utf-8 bytes"
        else:
            raise ValueError(f"{model}: carries no tokenizer ({', '.join(TOKENIZER_FILES)}) and its model's vocabulary is "
                             f"{vocab}, not 256 (byte-level), so {path} cannot be tokenized; give token ids as .json or .npy")
    if ids.numel():
        bad = ((ids < 0) | (ids >= vocab)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"{path}: token id {int(ids[i])} at position {i} is outside the vocabulary of {model} "
                             f"(0..{vocab - 1})")
    return Text(ids=ids, unit=unit, source=source)


def _json_ids(path: str) -> torch.Tensor:
    try:
        doc = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, list):
        raise ValueError(f"{path}: expected a JSON list of token ids, got a {type(doc).__name__}")
    bad = next((i for i, x in enumerate(doc) if not isinstance(x, int) or isinstance(x, bool)), None)
    if bad is not None:
        raise ValueError(f"{path}: entry {bad} is {json.dumps(doc[bad])[:40]}, not a token id (an int)")
    try:
        return torch.tensor(doc, dtype=torch.long)
    except (OverflowError, RuntimeError):
        raise ValueError(f"{path}: a token id does not fit in 64 bits") from None


def _npy_ids(path: str) -> torch.Tensor:
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D integer array of token ids, got {arr.ndim}-D {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{path}: token id {int(arr.max())} does not fit in 64 bits")
    return torch.from_numpy(arr.astype(np.int64))


def _tokenize(model: str | Path, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{model}: cannot load its tokenizer ({e})") from None
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def eval_windows(tokens: bytes | Sequence[int] | torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` windows of ``length`` tokens of ``tokens`` (the bytes of a text, or token ids),
    evenly spaced from its first token to its last (the first starts at token 0, the last ends at
    the end): token ids [count, length]."""
    if length < 2 or count < 1 or len(tokens) < length:
        raise ValueError(f"cannot take {count} windows of {length} tokens from {len(tokens)} tokens")
    if isinstance(tokens, (bytes, bytearray)):
        ids = torch.frombuffer(bytearray(tokens), dtype=torch.uint8).long()  # [n]
    else:
        ids = torch.as_tensor(tokens, dtype=torch.long)  # [n]
    last = len(ids) - length
    starts = [i * last // (count - 1) if count > 1 else 0 for i in range(count)]
    return torch.stack([ids[s:s + length] for s in starts])  # [count, length]
