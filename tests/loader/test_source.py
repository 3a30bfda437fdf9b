"""loader.source: a source checkpoint that is not one (a broken index, a shard that does not parse,
an index that puts a tensor in the wrong shard) is a ValueError naming the file, never a bare
KeyError or safetensors error, so the pack CLI can report it in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tiers.loader.source import INDEX_NAME, SourceCheckpoint

MODEL = "qwen3_moe"


def _copy(checkpoint_factory, tmp_path, **opts) -> Path:
    src = tmp_path / "hf"
    shutil.copytree(checkpoint_factory(MODEL, **opts), src)
    return src


def test_a_good_checkpoint_reads(checkpoint_factory, tmp_path):
    source = SourceCheckpoint(_copy(checkpoint_factory, tmp_path, max_shard_size="200KB"))
    key = "model.embed_tokens.weight"
    assert len(set(source.key_to_file.values())) > 1  # sharded, through the index
    assert source.meta(key) == ("BF16", list(source.get(key).shape))


@pytest.mark.parametrize("text, says", [
    ("{", "is not valid JSON (Expecting property name enclosed in double quotes"),
    ("{}", "has no 'weight_map' of tensor names to shard files"),
    ('{"weight_map": ["a"]}', "has no 'weight_map' of tensor names to shard files"),
    ('{"weight_map": {"a": 3}}', "has no 'weight_map' of tensor names to shard files"),
    ("[]", "has no 'weight_map' of tensor names to shard files"),
], ids=["not_json", "no_weight_map", "a_list", "not_file_names", "not_an_object"])
def test_a_broken_index_names_the_index(checkpoint_factory, tmp_path, text, says):
    src = _copy(checkpoint_factory, tmp_path, max_shard_size="200KB")
    (src / INDEX_NAME).write_text(text)
    with pytest.raises(ValueError) as e:
        SourceCheckpoint(src)
    assert str(e.value).startswith(f"source index {str(src / INDEX_NAME)!r} {says}"), str(e.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_shard_that_does_not_parse_names_the_shard(checkpoint_factory, tmp_path, damage):
    src = _copy(checkpoint_factory, tmp_path)
    shard = src / "model.safetensors"
    shard.write_bytes(b"garbage" if damage == "garbage" else shard.read_bytes()[:1000])
    with pytest.raises(ValueError) as e:
        SourceCheckpoint(src)
    assert str(e.value).startswith(f"source shard {str(shard)!r} cannot be read: Error while deserializing header")


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_names_the_shard(checkpoint_factory, tmp_path):
    src = _copy(checkpoint_factory, tmp_path, max_shard_size="200KB")
    doc = json.loads((src / INDEX_NAME).read_text())
    key = "model.embed_tokens.weight"
    other = next(f for f in sorted(set(doc["weight_map"].values())) if f != doc["weight_map"][key])
    doc["weight_map"][key] = other
    (src / INDEX_NAME).write_text(json.dumps(doc))
    source = SourceCheckpoint(src)  # the index is read, not every shard's header
    with pytest.raises(ValueError) as e:
        source.meta(key)
    assert str(e.value).startswith(f"source shard {str(src / other)!r} cannot be read: "), str(e.value)
    assert key in str(e.value)
