"""int4's group size from pack to load: ``options`` recorded per blob layout in the manifest, checked
by ``scheme_options``, by the manifest parser against the stored field shapes, by ``tools/pack.py
--config``, and by a load whose YAML sets ``tiers.int4.group``."""
from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import tiers
from tiers.loader.blob import blob_layout, scheme_options
from tiers.loader.manifest_parse import FormatError, checksum
from tiers.loader.pack import pack
from tiers.loader.packed import MANIFEST, read_manifest

pack_cli = importlib.import_module("tiers.tools.pack")
MODEL = "qwen3_moe"  # experts [96, 64] (gate and up) and [64, 48] (down): group 32 (the default) gives groups of 32 and 24, 64 of 64 and 48
PRECISIONS = ("bf16", "int8", "int4")
INT4_HOT = {"tiers": {"gpu": {"fraction": 1.0, "precision": "int4"}}}


@pytest.fixture(scope="module")
def group64(checkpoint_factory, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("group64") / "packed"
    pack(checkpoint_factory(MODEL), dst, precisions=PRECISIONS, progress=False, options={"int4": {"group": 64}})
    return dst


@pytest.fixture
def default_copy(packed_factory, tmp_path) -> Path:
    dst = tmp_path / "packed"
    shutil.copytree(packed_factory(MODEL, PRECISIONS), dst)
    return dst


def layer_docs(root: Path) -> list[dict]:
    return json.loads((root / MANIFEST).read_text())["layers"]


def edit(root: Path, change) -> None:
    """``change(doc)`` on the manifest, its checksum re-sealed (an edit that keeps the checksum right)."""
    doc = json.loads((root / MANIFEST).read_text())
    change(doc)
    doc["checksum"] = checksum(doc)
    (root / MANIFEST).write_text(json.dumps(doc))


def scales_of(root: Path) -> dict[str, tuple]:
    """Each int4 tensor's scale shape in layer 0's blob layout."""
    return {f.tensor: f.spec.shape for f in read_manifest(root).layers[0].blobs["int4"].fields if f.spec.name == "scale"}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(1, 17).view(1, -1)).logits


# -- the manifest records it ---------------------------------------------------------------------
def test_a_pack_records_its_group_in_every_int4_layout(group64, packed_factory):
    for root, group, scales in ((group64, 64, {"gate_up_proj": (96, 1), "down_proj": (64, 1)}),
                                (packed_factory(MODEL, PRECISIONS), 32, {"gate_up_proj": (96, 2), "down_proj": (64, 2)})):
        docs = layer_docs(root)
        assert len(docs) == 3
        for layer in docs:
            assert layer["blobs"]["int4"]["options"] == {"group": group}
            assert "options" not in layer["blobs"]["int8"] and "options" not in layer["blobs"]["bf16"]
        m = read_manifest(root)
        assert all(dict(e.blobs["int4"].options) == {"group": group} for e in m.layers.values())
        assert scales_of(root) == scales, root


def test_scheme_options_refuses_what_a_precision_does_not_take():
    assert scheme_options("int4", None) == (("group", 32),)
    assert scheme_options("int4", {"group": 64}) == (("group", 64),)
    assert scheme_options("int8", None) == () and scheme_options("bf16", {}) == ()
    with pytest.raises(ValueError, match=r"^precision 'int8' takes no setting 'group'$"):
        scheme_options("int8", {"group": 32})
    with pytest.raises(ValueError, match=r"^precision 'int4' takes no setting 'groups'; it takes \['group'\]$"):
        scheme_options("int4", {"groups": 32})
    for bad in (32.0, "32", True, None):
        with pytest.raises(ValueError, match=rf"^precision 'int4': setting 'group' must be an integer, got {bad!r}$"):
            scheme_options("int4", {"group": bad})
    for bad in (1, 0, -64):
        with pytest.raises(ValueError, match=rf"^precision 'int4': setting 'group' must be at least 2, got {bad}$"):
            scheme_options("int4", {"group": bad})


def test_pack_refuses_a_bad_setting_before_writing(checkpoint_factory, tmp_path):
    for options, says in (({"int4": {"group": 1}}, "must be at least 2"), ({"int8": {"group": 32}}, "'int8' takes no setting")):
        with pytest.raises(ValueError, match=says):
            pack(checkpoint_factory(MODEL), tmp_path / "out", precisions=PRECISIONS, progress=False, options=options)
        assert not (tmp_path / "out").exists()


# -- a manifest whose options were edited ----------------------------------------------------------
@pytest.mark.parametrize("value, says", [
    # field shapes the stored layout does not have: the blobs would decode with other groups
    (64, r"layers\[0\]\.blobs\.int4: differs from this build's int4 blob layout for the layer's layout \(field 'scale' of "
         r"'gate_up_proj': 'uint8' \[96, 2\] in the pack, 'uint8' \[96, 1\] in this build\); re-pack$"),
    (1, r"layers\[0\]\.blobs\.int4\.options: ValueError\(\"precision 'int4': setting 'group' must be at least 2, got 1\"\)"),
    ("64", r"layers\[0\]\.blobs\.int4\.options: ValueError\(\"precision 'int4': setting 'group' must be an integer, got '64'\"\)"),
])
def test_an_edited_group_that_changes_the_layout_is_refused_naming_the_field(default_copy, value, says):
    edit(default_copy, lambda doc: doc["layers"][0]["blobs"]["int4"]["options"].update(group=value))
    with pytest.raises(FormatError, match=says):
        read_manifest(default_copy)


def test_removed_options_are_refused(default_copy):
    edit(default_copy, lambda doc: doc["layers"][2]["blobs"]["int4"].pop("options"))
    with pytest.raises(FormatError, match=r"layers\[2\]\.blobs\.int4: differs from this build's int4 blob layout for the layer's "
                                          r"layout; re-pack$"):
        read_manifest(default_copy)


def test_a_pack_of_the_former_int4_format_is_refused_naming_the_field(default_copy):
    """int4 packs made before the compact statistics stored fp16 group scales (and zero points one a
    byte, no row scale): refused at load, naming the precision, the field and both forms."""
    def old_format(doc):
        for layer in doc["layers"]:
            for f in layer["blobs"]["int4"]["fields"]:
                if f["field"] == "scale":
                    f["dtype"] = "float16"
    edit(default_copy, old_format)
    with pytest.raises(FormatError) as e:
        tiers.load(default_copy, INT4_HOT, device="cpu", progress=False)
    assert str(e.value) == (f"{default_copy / MANIFEST}: layers[0].blobs.int4: differs from this build's int4 blob layout for the "
                            f"layer's layout (field 'scale' of 'gate_up_proj': 'float16' [96, 2] in the pack, 'uint8' [96, 2] in this "
                            f"build); re-pack")


def test_an_edited_group_that_keeps_every_field_shape_loads_the_same(default_copy, packed_factory):
    """Rows of 64 and 48 take groups of 32 and 24 whether 32 or 33 is asked for: the same fields, and
    the decode takes its groups from the field shapes, so the edited pack loads with the same logits.
    (A config asking for 32 then differs from the recorded 33, and is refused.)"""
    edit(default_copy, lambda doc: [layer["blobs"]["int4"]["options"].update(group=33) for layer in doc["layers"]])
    assert all(dict(e.blobs["int4"].options) == {"group": 33} for e in read_manifest(default_copy).layers.values())
    assert blob_layout(read_manifest(default_copy).layers[0].layout, "int4", {"group": 33}).fields == \
        read_manifest(packed_factory(MODEL, PRECISIONS)).layers[0].blobs["int4"].fields
    edited = tiers.load(default_copy, INT4_HOT, device="cpu", progress=False)
    plain = tiers.load(packed_factory(MODEL, PRECISIONS), INT4_HOT, device="cpu", progress=False)
    assert torch.equal(logits(edited), logits(plain))
    with pytest.raises(ValueError, match=r"tiers\.int4\.group: 32, but .* was packed with int4 group 33"):
        tiers.load(default_copy, {"tiers": {**INT4_HOT["tiers"], "int4": {"group": 32}}}, device="cpu", progress=False)


# -- tools/pack.py --config, and a load's config ---------------------------------------------------
def test_pack_cli_config_packs_its_group(checkpoint_factory, tmp_path, capsys):
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text("tiers:\n  cpu: {precision: int4}\n  nvme: {precision: int8}\n  int4: {group: 64}\n")
    dst = tmp_path / "packed"
    rc = pack_cli.main([str(checkpoint_factory(MODEL)), str(dst), "--config", str(cfg), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    m = read_manifest(dst)
    assert m.precisions == ("bf16", "int4", "int8")
    assert all(dict(e.blobs["int4"].options) == {"group": 64} for e in m.layers.values())
    assert scales_of(dst) == {"gate_up_proj": (96, 1), "down_proj": (64, 1)}
    model = tiers.load(dst, cfg, device="cpu", progress=False)  # the same YAML loads it
    assert torch.isfinite(logits(model)).all()


def test_a_load_asking_another_group_is_refused_naming_both(packed_factory, tmp_path):
    root = packed_factory(MODEL, PRECISIONS)  # group 32
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text("tiers:\n  gpu: {fraction: 1.0, precision: int4}\n  int4: {group: 64}\n")
    with pytest.raises(ValueError) as e:
        tiers.load(root, cfg, device="cpu", progress=False)
    assert str(e.value) == (f"tiers.int4.group: 64, but {root} was packed with int4 group 32; re-pack it with this config, "
                            f"or leave the key out")
    without = tiers.load(root, INT4_HOT, device="cpu", progress=False)
    same = tiers.load(root, {"tiers": {**INT4_HOT["tiers"], "int4": {"group": 32}}}, device="cpu", progress=False)
    assert torch.equal(logits(without), logits(same))


def test_a_group_changes_the_decoded_weights(group64, packed_factory):
    """Group 32 is not group 64 relabelled: finer groups, other logits (closer to bf16's)."""
    bf16 = {"tiers": {"gpu": {"fraction": 1.0, "precision": "bf16"}}}
    ref = logits(tiers.load(group64, bf16, device="cpu", progress=False))
    g32 = logits(tiers.load(packed_factory(MODEL, PRECISIONS), INT4_HOT, device="cpu", progress=False))
    g64 = logits(tiers.load(group64, INT4_HOT, device="cpu", progress=False))
    assert not torch.equal(g32, g64)
    assert (g32.float() - ref.float()).pow(2).mean() < (g64.float() - ref.float()).pow(2).mean()
