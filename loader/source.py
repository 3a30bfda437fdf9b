"""Reading a Hugging Face checkpoint directory (``save_pretrained`` output), shard by shard.

Owns: listing the shards (through ``model.safetensors.index.json`` when present) and reading
single tensors or single experts' slices through ``safe_open``, which maps the file and never
holds a whole shard. A shard named by the index but absent is an error naming that file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"


class SourceCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"source checkpoint {str(self.path)!r} is not a directory")
        if not (self.path / "config.json").is_file():
            raise ValueError(f"source checkpoint {str(self.path)!r} has no config.json (expected save_pretrained output)")
        index = self.path / INDEX_NAME
        self.key_to_file: dict[str, str] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            for fname in sorted(set(weight_map.values())):
                if not (self.path / fname).is_file():
                    raise FileNotFoundError(f"shard {fname!r} listed in {INDEX_NAME} is missing from {str(self.path)!r}")
            self.key_to_file = dict(weight_map)
        else:
            shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                raise ValueError(f"source checkpoint {str(self.path)!r} has no *.safetensors files")
            for fname in shards:
                with safe_open(self.path / fname, framework="pt") as f:
                    for key in f.keys():
                        self.key_to_file[key] = fname

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    # Each read opens the shard and closes it again: a handle kept open keeps every page it
    # touched mapped into this process, so a long pack would count the whole checkpoint in its
    # resident set. Re-opening costs one header parse.
    def get(self, key: str) -> torch.Tensor:
        with safe_open(self.path / self.key_to_file[key], framework="pt") as f:
            return f.get_tensor(key)

    def get_expert(self, key: str, expert: int) -> torch.Tensor:
        """One expert's slice ``[expert]`` of a fused [E, ...] tensor, read without the rest."""
        with safe_open(self.path / self.key_to_file[key], framework="pt") as f:
            return f.get_slice(key)[expert]

    def meta(self, key: str) -> tuple[str, list[int]]:
        """(safetensors dtype name, shape) without reading the data."""
        with safe_open(self.path / self.key_to_file[key], framework="pt") as f:
            sl = f.get_slice(key)
            return sl.get_dtype(), list(sl.get_shape())

    def carried_files(self) -> list[Path]:
        """Everything that is not weights: config, generation config, tokenizer files."""
        skip_suffixes = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")
        return sorted(
            p for p in self.path.iterdir()
            if p.is_file() and not p.name.endswith(skip_suffixes) and p.name != INDEX_NAME
        )
