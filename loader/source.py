"""Reading a Hugging Face checkpoint directory (``save_pretrained`` output), shard by shard.

Owns: listing the shards (through ``model.safetensors.index.json`` when present) and reading
single tensors or single experts' slices through ``safe_open``, which maps the file and never
holds a whole shard. Errors name the file: a shard named by the index but absent, an index that
is not JSON or has no ``weight_map`` of names to shard files, a shard whose header does not parse
(a ValueError, where safetensors' own error names no file).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import source_formats

INDEX_NAME = "model.safetensors.index.json"


class SourceCheckpoint:
    formats: source_formats.SourceFormats | None = None  # quantized pairs, read decoded (set once the keys are listed)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"source checkpoint {str(self.path)!r} is not a directory")
        if not (self.path / "config.json").is_file():
            raise ValueError(f"source checkpoint {str(self.path)!r} has no config.json (expected save_pretrained output)")
        index = self.path / INDEX_NAME
        self.key_to_file: dict[str, str] = {}
        if index.is_file():
            weight_map = _weight_map(index)
            for fname in sorted(set(weight_map.values())):
                if not (self.path / fname).is_file():
                    raise FileNotFoundError(f"shard {fname!r} listed in {INDEX_NAME} is missing from {str(self.path)!r}")
            self.key_to_file = dict(weight_map)
        else:
            shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                raise ValueError(f"source checkpoint {str(self.path)!r} has no *.safetensors files")
            for fname in shards:
                with self._open(fname) as f:
                    for key in f.keys():
                        self.key_to_file[key] = fname
        self.key_to_file, self.formats = source_formats.read(self.path, self.key_to_file, self._open)  # pairs -> plain names

    @contextmanager
    def _open(self, fname: str) -> Iterator:
        """``safe_open`` on one shard; a shard that does not parse, or lacks a tensor the index
        puts in it, is a ValueError naming the shard."""
        try:
            with safe_open(self.path / fname, framework="pt") as f:
                yield f if self.formats is None else self.formats.handle(f, fname)
        except SafetensorError as e:
            raise ValueError(f"source shard {str(self.path / fname)!r} cannot be read: {e}") from None

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    # Each read opens the shard and closes it again: a handle kept open keeps every page it
    # touched mapped into this process, so a long pack would count the whole checkpoint in its
    # resident set. Re-opening costs one header parse.
    def get(self, key: str) -> torch.Tensor:
        with self._open(self.key_to_file[key]) as f:
            return f.get_tensor(key)

    def get_expert(self, key: str, expert: int) -> torch.Tensor:
        """One expert's slice ``[expert]`` of a fused [E, ...] tensor, read without the rest."""
        with self._open(self.key_to_file[key]) as f:
            return f.get_slice(key)[expert]

    def meta(self, key: str) -> tuple[str, list[int]]:
        """(safetensors dtype name, shape) without reading the data."""
        with self._open(self.key_to_file[key]) as f:
            sl = f.get_slice(key)
            return sl.get_dtype(), list(sl.get_shape())

    def carried_files(self) -> list[Path]:
        """Everything that is not weights: config, generation config, tokenizer files."""
        skip_suffixes = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")
        return sorted(
            p for p in self.path.iterdir()
            if p.is_file() and not p.name.endswith(skip_suffixes) and p.name != INDEX_NAME
        )


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file), checked; ValueError naming the index."""
    try:
        doc = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"source index {str(index)!r} is not valid JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"source index {str(index)!r} has no 'weight_map' of tensor names to shard files")
    return weight_map
