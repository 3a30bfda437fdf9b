"""tools/timeline.py: a prefill's copy-stream busy time, gaps and layer boundaries from
synthetic marks with known device times."""
from __future__ import annotations

import math
import os

import pytest

from tiers.tools import timeline
from tiers.tools.timeline import split


def _layer(i: int, t: float, attn: float, sync: float, plan: float, parts: list[float], gap: float, tail: float) -> tuple[list, float]:
    """Marks of one streamed layer, host and device clocks equal: ``attn`` ms to the experts call,
    ``sync`` ms to the route's return, ``plan`` ms to the first copy, copies of ``parts`` ms with
    ``gap`` ms between them, ``tail`` ms from the last copy to the call's end."""
    marks = [("layer", i, t, t)]
    t += attn
    marks.append(("experts", i, t, t))
    t += sync
    marks.append(("routed", i, t, t))
    t += plan
    for n, d in enumerate(parts):
        if n:
            t += gap
        marks.append(("copy_start", i, t, t))
        t += d
        marks.append(("copy_end", i, t, t))
    t += tail
    marks.append(("experts_end", i, t, t))
    return marks, t


def _prefill(layers: int, **kw) -> list:
    marks, t = [], 0.0
    for i in range(layers):
        got, t = _layer(i, t, **kw)
        marks += got
    return marks


def test_split_of_a_synthetic_prefill():
    kw = dict(attn=1.0, sync=0.5, plan=0.25, parts=[0.75, 0.75, 0.5], gap=0.125, tail=0.375)
    got = split(_prefill(4, **kw))
    med, total = got["median"], got["total"]
    assert med["parts"] == 3
    assert math.isclose(med["copy_ms"], 2.0) and math.isclose(med["copy_gaps_ms"], 0.25)
    # from a layer's last copy to the next layer's first: tail, attention, sync, plan
    assert math.isclose(med["boundary_ms"], 0.375 + 1.0 + 0.5 + 0.25)
    assert math.isclose(med["boundary_gpu_ms"], 0.375 + 1.0 + 0.5)
    assert math.isclose(med["boundary_plan_ms"], 0.25)
    assert math.isclose(med["tail_ms"], 0.375)
    assert math.isclose(med["host_attn_ms"], 1.0) and math.isclose(med["host_route_ms"], 0.5)
    layer_ms = 1.0 + 0.5 + 0.25 + 2.0 + 0.25 + 0.375
    assert math.isclose(med["host_call_ms"], layer_ms - 1.5)
    assert math.isclose(med["device_layer_ms"], layer_ms) and math.isclose(med["host_layer_ms"], layer_ms)
    assert total["streamed_layers"] == 4
    assert math.isclose(total["device_ms"], 4 * layer_ms)
    assert math.isclose(total["copy_ms"], 8.0) and math.isclose(total["copy_busy"], 8.0 / (4 * layer_ms))
    assert math.isclose(total["boundary_ms"], 3 * 2.125)  # the first layer has no earlier copy
    # device time = the first layer's lead + copies + gaps + boundaries + the last tail
    lead = 1.0 + 0.5 + 0.25
    assert math.isclose(total["device_ms"], lead + total["copy_ms"] + total["copy_gaps_ms"] + total["boundary_ms"] + 0.375)


def test_a_read_ahead_shortens_the_next_boundary():
    marks = _prefill(2, attn=1.0, sync=0.5, plan=0.25, parts=[1.0], gap=0.0, tail=0.5)
    # a read-ahead that ends 0.5 ms after layer 0's last copy, queued by layer 0 for layer 1
    end0 = next(d for w, L, _, d in marks if w == "copy_end" and L == 0)
    marks.append(("ahead_end", 1, end0 + 0.5, end0 + 0.5))
    marks.sort(key=lambda m: m[3])
    got = split(marks)
    row = got["layers"][1]
    assert math.isclose(row["boundary_ms"], 0.5 + 1.0 + 0.5 + 0.25 - 0.5)


def test_layers_without_copies_have_no_copy_figures():
    marks = [("layer", 0, 0.0, 0.0), ("experts", 0, 1.0, 1.0), ("routed", 0, 1.5, 1.5), ("experts_end", 0, 2.0, 2.0),
             ("layer", 1, 2.5, 2.5), ("experts", 1, 3.0, 3.0), ("experts_end", 1, 3.5, 3.5)]
    got = split(marks)
    assert got["total"]["streamed_layers"] == 0 and got["total"]["copy_ms"] == 0
    assert "copy_ms" not in got["median"] and math.isclose(got["median"]["host_attn_ms"], 0.75)
    assert math.isclose(got["layers"][0]["host_layer_ms"], 2.5)


def test_marking_marks_only_inside_its_block_and_undoes_its_hooks_even_when_it_raises(packed_factory):
    import pytest
    import torch

    import tiers
    from tiers.api import manager_of
    from tiers.tools.timeline import Marks, marking

    cfg = {"tiers": {"gpu": {"fraction": 0.4, "staging_slots": 4}, "cpu": {"budget": "64MiB", "precision": "bf16"},
                     "nvme": {"precision": "bf16"}}}
    model = tiers.load(packed_factory("qwen3_moe"), cfg, device="cpu", progress=False)
    mgr = manager_of(model)
    wrapped = (mgr, mgr.streamed, mgr.staging, mgr.uploads)
    attrs = [set(vars(o)) for o in wrapped]
    hooks = [(len(layer._forward_pre_hooks), len(layer.mlp.experts._forward_hooks)) for layer in model.model.layers]
    ids = torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    marks = Marks(cuda=False)
    with marking(model, mgr, marks):
        assert marks.on
        with torch.no_grad():
            model(ids)
    assert not marks.on and {w for w, *_ in marks.raw} >= {"layer", "experts", "experts_end", "routed"}
    taken = len(marks.raw)
    with torch.no_grad():
        model(ids)  # outside the block: no marks
    assert len(marks.raw) == taken
    with pytest.raises(RuntimeError, match="in the block"):
        with marking(model, mgr, marks):
            raise RuntimeError("in the block")
    assert not marks.on and [set(vars(o)) for o in wrapped] == attrs
    assert [(len(layer._forward_pre_hooks), len(layer.mlp.experts._forward_hooks)) for layer in model.model.layers] == hooks
    mgr.close()


def test_host_syncs_name_where_each_sync_was_made_and_set_the_mode_back():
    """A fake setter and getter stand in for torch's (CPU torch has no sync debug mode): the
    block's sync warnings are recorded with the line of this repository's code that made them,
    other warnings are not, and the mode goes back to what it was (default, or as set before the
    block) also when the block raises."""
    import functools
    import warnings

    modes = []
    host_syncs = functools.partial(timeline.host_syncs, get_mode=lambda: "default")

    def synced():
        warnings.warn("called a synchronizing CUDA operation")  # the line recorded

    with host_syncs(True, set_mode=modes.append) as syncs:
        synced()
        warnings.warn("something else")
        assert modes == ["warn"]
    line = synced.__code__.co_firstlineno + 1
    assert syncs == [f"tests/tools/test_timeline.py:{line}"] and modes == ["warn", "default"]
    with pytest.raises(RuntimeError):
        with host_syncs(True, set_mode=modes.append):
            raise RuntimeError("boom")
    assert modes[-1] == "default"
    with pytest.raises(RuntimeError):
        with timeline.host_syncs(True, set_mode=modes.append, get_mode=lambda: 2):  # "error" set before the block
            raise RuntimeError("boom")
    assert modes[-2:] == ["warn", 2]
    del modes[-2:]

    def warning_setter(mode):  # torch's setter itself warned on CUDA: not the block's sync
        modes.append(mode)
        warnings.warn("called a synchronizing CUDA operation")
    with host_syncs(True, set_mode=warning_setter) as syncs:
        pass
    assert syncs == [] and modes[-2:] == ["warn", "default"]
    del modes[-2:]
    with host_syncs(False, set_mode=modes.append) as none, pytest.warns(UserWarning, match="synchronizing"):
        synced()
    assert none == [] and len(modes) == 4  # off: the mode is not touched


def test_a_site_outside_the_repository_names_the_repositorys_caller():
    from types import SimpleNamespace as F

    ours = F(filename=os.path.join(timeline._REPO, "tiers", "streamed.py"), lineno=390)
    torch_frame = F(filename=os.path.join("/somewhere", "site-packages", "torch", "_tensor.py"), lineno=7)
    stdlib = F(filename="/usr/lib/python3/threading.py", lineno=3)
    assert timeline._site([stdlib, ours]) == "tiers/streamed.py:390"
    assert timeline._site([stdlib, ours, torch_frame]) == "tiers/streamed.py:390 (torch/_tensor.py:7)"
    assert timeline._site([stdlib]) == "threading.py:3"
