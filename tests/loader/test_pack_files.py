"""The packed files against the manifest: a change to any carried, dense or expert file, or to what
the manifest claims about them, is refused at load naming the file (and the field or expert); file
names never leave the pack directory; after load no weight depends on the files."""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from conftest import flip_byte
import tiers
from tiers.loader.manifest_parse import FormatError, checksum
from tiers.loader.pack_files import IntegrityError, _placed, verify_files
from tiers.loader.packed import MANIFEST, read_manifest

MODEL = "qwen3_moe"
RESIDENT = {"tiers": {"gpu": {"fraction": 1.0, "precision": "bf16"}}}  # nothing read from disk after load


@pytest.fixture
def packed_copy(packed_factory, tmp_path) -> Path:
    dst = tmp_path / "packed"
    shutil.copytree(packed_factory(MODEL, ("bf16", "int8")), dst)
    return dst


def _edit(root: Path, change) -> None:
    """Change the manifest with ``change(doc)`` and re-seal it (a hostile or careless edit that keeps the checksum right)."""
    doc = json.loads((root / MANIFEST).read_text())
    change(doc)
    doc["checksum"] = checksum(doc)
    (root / MANIFEST).write_text(json.dumps(doc))


def _load(root: Path):
    return tiers.load(root, RESIDENT, device="cpu", progress=False)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(1, 17).view(1, -1)).logits


def test_a_clean_pack_verifies_and_returns_its_carried_bytes(packed_copy):
    carried = verify_files(read_manifest(packed_copy))
    assert carried["config.json"] == (packed_copy / "config.json").read_bytes()
    assert set(carried) == {p.name for p in packed_copy.iterdir() if p.name.endswith(".json") and p.name != MANIFEST}


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_carried_file_changed_by_one_digit_is_refused(packed_copy, name):
    path = packed_copy / name
    text = path.read_text()
    digit = next(i for i, c in enumerate(text) if c.isdigit())
    path.write_text(text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1:])  # same size, one digit off
    with pytest.raises(IntegrityError, match=rf"carried file '.*{name}' differs from the manifest's record"):
        _load(packed_copy)


def test_num_experts_per_tok_changed_is_refused(packed_copy):
    path = packed_copy / "config.json"
    doc = json.loads(path.read_text())
    doc["num_experts_per_tok"] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="config.json"):
        _load(packed_copy)


@pytest.mark.parametrize("which", ["dense", "expert"])
@pytest.mark.parametrize("how", ["truncate", "missing"])
def test_a_short_or_missing_weights_file_is_refused_at_load(packed_copy, which, how):
    m = read_manifest(packed_copy)
    name = sorted(m.dense_files if which == "dense" else m.expert_files)[-1]
    path = packed_copy / name
    if how == "truncate":
        os.truncate(path, path.stat().st_size - 1)
    else:
        path.unlink()
    with pytest.raises(IntegrityError, match=str(path)):
        _load(packed_copy)


def test_an_expert_file_header_changed_is_refused(packed_copy):
    m = read_manifest(packed_copy)
    name = sorted(m.expert_files)[0]
    flip_byte(packed_copy / name, 20)
    with pytest.raises(IntegrityError, match=rf"expert file '.*{name}': its header differs"):
        verify_files(read_manifest(packed_copy))


def test_a_reference_moved_onto_another_experts_blob_is_refused(packed_copy):
    def swap(doc):
        experts = doc["layers"][0]["experts"]
        experts[1]["expert"], experts[2]["expert"] = 2, 1  # ids still 0..n-1; each now names the other's blob
    _edit(packed_copy, swap)
    with pytest.raises(FormatError, match=r"layer-\d+\.safetensors: expert [12]: the manifest's offset \d+ .* is not the header's 'expert\.[12]' entry"):
        verify_files(read_manifest(packed_copy))


def test_swapped_layers_are_refused(packed_copy):
    def swap(doc):
        a, b = doc["layers"][0], doc["layers"][1]
        a["layer"], b["layer"], a["module"], b["module"] = b["layer"], a["layer"], b["module"], a["module"]
    _edit(packed_copy, swap)
    with pytest.raises(FormatError, match=r"layer-\d+\.safetensors: the file is .*'layer': '\d+'.* but the manifest uses it as"):
        verify_files(read_manifest(packed_copy))


def test_overlapping_blobs_are_refused():
    header = {"expert.0": {"data_offsets": [0, 100]}, "expert.1": {"data_offsets": [50, 150]}}
    with pytest.raises(FormatError, match="experts 0 and 1 overlap"):
        _placed(Path("f"), header, 8, [(0, 8, 100), (1, 58, 100)])
    _placed(Path("f"), header, 8, [(0, 8, 50), (1, 58, 100)])  # touching is fine


def test_a_dense_tensor_in_two_files_is_refused(packed_copy):
    m = read_manifest(packed_copy)
    first = sorted(m.dense_files)[0]
    shutil.copy(packed_copy / first, packed_copy / "dense-copy.safetensors")
    _edit(packed_copy, lambda doc: doc["dense"]["files"].update({"dense-copy.safetensors": doc["dense"]["files"][first]}))
    with pytest.raises(FormatError, match=r"dense-copy\.safetensors: tensor '.*' is also in 'dense-0000"):
        _load(packed_copy)


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.safetensors", "./dense.safetensors", "experts//x", "link.safetensors"])
def test_file_names_leaving_the_pack_directory_are_refused_naming_the_entry(packed_copy, tmp_path, name):
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    os.symlink(tmp_path / "outside.safetensors", packed_copy / "link.safetensors")
    _edit(packed_copy, lambda doc: doc["dense"]["files"].update({name: {"crc32": 0, "nbytes": 1}}))
    with pytest.raises(FormatError, match=re.escape(f"manifest.json: dense.files[{name!r}]: file ") + ".* (leaves|resolves outside) the pack directory"):
        read_manifest(packed_copy)


def test_a_manifest_key_given_twice_is_refused(packed_copy):
    text = (packed_copy / MANIFEST).read_text()
    (packed_copy / MANIFEST).write_text(text.replace('"format":', '"model_type": "mixtral", "format":', 1))
    with pytest.raises(FormatError, match="key 'model_type' appears twice"):
        read_manifest(packed_copy)


def test_after_load_no_weight_depends_on_the_files(packed_copy):
    """Edit and truncate every packed file after load: the output is unchanged and nothing crashes."""
    model = _load(packed_copy)
    before = _logits(model)
    for path in sorted(p for p in packed_copy.rglob("*") if p.is_file()):
        data = bytearray(path.read_bytes())
        data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # the second half zeroed...
        path.write_bytes(bytes(data))
        os.truncate(path, len(data) // 3)  # ...then the file cut to a third
    assert torch.equal(_logits(model), before)


# -- found by the fuzz suite (tests/tiers/test_fuzz.py) ------------------------------------------------
def _carry(root: Path, name: str, change) -> None:
    """Change carried JSON file ``name`` with ``change(doc)`` and re-seal the manifest's record of it (an edit that keeps every checksum right)."""
    doc = json.loads((root / name).read_text())
    change(doc)
    data = json.dumps(doc).encode()
    (root / name).write_bytes(data)
    _edit(root, lambda m: m["carried"].update({name: {"crc32": zlib.crc32(data), "nbytes": len(data)}}))


def test_a_manifest_that_is_a_symlink_out_of_the_pack_is_refused(packed_copy, tmp_path):
    """The manifest is confined like every file it names (it used to be read through the symlink)."""
    outside = tmp_path / "outside.json"
    shutil.move(packed_copy / MANIFEST, outside)
    os.symlink(outside, packed_copy / MANIFEST)
    with pytest.raises(FormatError, match=r"manifest\.json: resolves outside the pack directory"):
        read_manifest(packed_copy)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_fifo_in_place_of_a_carried_file_is_refused_not_waited_on(packed_copy, name):
    """A FIFO is never opened to wait for a writer (a load used to hang there, before any check)."""
    (packed_copy / name).unlink(missing_ok=True)
    os.mkfifo(packed_copy / name)
    _edit(packed_copy, lambda doc: doc["carried"].setdefault(name, {"crc32": 0, "nbytes": 2}))
    with pytest.raises(IntegrityError, match=rf"carried file '.*{re.escape(name)}' is not a regular file"):
        _load(packed_copy)


def test_a_file_where_the_experts_folder_was_is_refused(packed_copy):
    shutil.rmtree(packed_copy / "experts")
    (packed_copy / "experts").write_bytes(b"")
    with pytest.raises(IntegrityError, match=r"expert file '.*experts/.*\.safetensors' cannot be read \(Not a directory\)"):
        _load(packed_copy)


@pytest.mark.parametrize("offsets", [[4096], [0, 1, 2], "0-100", None])
def test_a_header_entry_with_malformed_data_offsets_is_refused(offsets):
    with pytest.raises(FormatError, match=r"expert 0: the manifest's offset 8 .* is not the header's 'expert\.0' entry"):
        _placed(Path("f"), {"expert.0": {"data_offsets": offsets}}, 8, [(0, 8, 100)])


def test_a_layout_of_infinite_size_is_refused(packed_copy):
    _edit(packed_copy, lambda doc: doc["layers"][1]["layout"]["tensors"][0]["shape"].__setitem__(1, float("inf")))
    with pytest.raises(FormatError, match=r"manifest\.json: layers\[1\]\.layout: not an expert layout"):
        read_manifest(packed_copy)


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(pad_token_id="x"), r"config\.json: not a qwen3_moe config \(StrictDataclassFieldValidationError: .*pad_token_id"),
    (lambda c: c.update(hidden_size=-1), r"config\.json: no qwen3_moe model can be built from it \(RuntimeError: .*negative dimension"),
    (lambda c: c.update(num_local_experts=16), r"config\.json: layer 0's experts \(model\.layers\.0\.mlp\.experts\) do not match the layout "
                                         r".*manifest\.json packed for it"),
    (lambda c: c.update(num_hidden_layers=2), r"config\.json: the model it builds has MoE layers \[0, 1\], .*manifest\.json packed \[0, 1, 2\]"),
    # placement's staging slots counted down from 2 x 10**30 (a hang); 0 routes to nothing, -1 or 9 fail inside the forward
    *[(lambda c, k=k: c.update(num_experts_per_tok=k), rf"config\.json: num_experts_per_tok is {k}, expected 1\.\.8 ")
      for k in (10**30, 9, 0, -1)],
])
def test_a_resealed_config_no_model_matches_is_refused_naming_it(packed_copy, change, match):
    """config.json edited and its record re-sealed: whatever transformers or the model raise on its
    values, or its experts differing from the packed ones, is a FormatError naming the file."""
    _carry(packed_copy, "config.json", change)
    with pytest.raises(FormatError, match=match):
        _load(packed_copy)


@pytest.mark.parametrize("key, value", [("watermarking_config", 3), ("pad_token_id", "x"), ("max_new_tokens", -1)])
def test_a_resealed_generation_config_transformers_refuses_is_refused_naming_it(packed_copy, key, value):
    """Whatever GenerationConfig raises on the carried file's values (AttributeError, TypeError,
    ValueError) is a FormatError naming generation_config.json."""
    _carry(packed_copy, "generation_config.json", lambda doc: doc.update({key: value}))
    with pytest.raises(FormatError, match=r"generation_config\.json: not a generation config \(\w+: "):
        _load(packed_copy)


def test_a_layer_of_more_experts_than_it_lists_is_refused_before_anything_is_sized_by_it(packed_copy):
    """num_experts of 10**30 raised OverflowError (a list that long); 2**31 would have filled memory."""
    for n in (10**30, 2**31, 9):
        _edit(packed_copy, lambda doc: doc["layers"][2]["layout"].update(num_experts=n))
        with pytest.raises(FormatError, match=rf"manifest\.json: layers\[2\]\.experts: 8 entries, the layer's layout has {n} experts"):
            read_manifest(packed_copy)
