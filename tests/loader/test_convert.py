"""Transformers' weight converters at pack time (``loader.convert``): groups planned without reading
data, and each written group exactly what ``from_pretrained`` makes of the same keys."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import families
from tiers.loader.convert import Converted
from tiers.loader.pack import _plan
from tiers.loader.skeleton import build_skeleton
from tiers.loader.source import SourceCheckpoint


@pytest.fixture(scope="module")
def lara_mini(tmp_path_factory):
    """A family whose checkpoint holds one fused linear-attention input projection that
    transformers splits in four on load (a ``Split`` converter)."""
    path = tmp_path_factory.mktemp("hf-lara_mini")
    families.tiny_model("lara_mini").save_pretrained(path)
    return path


def test_converter_groups_are_planned_without_reading_data(lara_mini, monkeypatch):
    def no_read(self, key, *args):
        raise AssertionError(f"planning read {key!r}")

    monkeypatch.setattr(SourceCheckpoint, "get", no_read)
    monkeypatch.setattr(SourceCheckpoint, "get_expert", no_read)
    model = build_skeleton(AutoConfig.from_pretrained(lara_mini))
    plan = _plan(SourceCheckpoint(lara_mini), model)
    split = [g for g in plan.converted if g.target.endswith("linear_attn.in_proj_qkv.weight")]
    assert split, [g.target for g in plan.converted]
    made = set(split[0].outputs)
    prefix = split[0].target.rsplit("in_proj_qkv", 1)[0]
    assert made == {f"{prefix}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")}
    params = dict(model.named_parameters())
    for key, (dtype, shape) in split[0].outputs.items():
        assert shape == list(params[key].shape), key


def test_a_group_runs_on_its_own_sources_only(lara_mini):
    """Running a group reads exactly its source keys, once each (the pack holds one group at a time)."""
    src = SourceCheckpoint(lara_mini)
    model = build_skeleton(AutoConfig.from_pretrained(lara_mini))
    plan = _plan(src, model)
    group: Converted = plan.converted[0]
    read = []
    out = group.run(plan.keymap, model, lambda k: read.append(k) or src.get(k))
    assert sorted(read) == sorted(k for _, k in group.sources)
    assert set(out) >= set(group.outputs)
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in out.values())
