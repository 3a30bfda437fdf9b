"""tiers.policy.placement: the staging slots it picks on its own ("auto"), and the top-k it reads for them.

Expected counts are re-derived from the raw ``manifest.json`` numbers (placement_helpers.py),
never from the function under test.
"""
from __future__ import annotations

import json

import pytest

from placement_helpers import Facts, check, expect, facts
from tiers.config import parse_config
from tiers.loader.packed import read_manifest
from tiers.policy import placement
from tiers.policy.placement import plan_placement


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(packed_factory):
    return packed_factory("mixtral")


@pytest.fixture(scope="module")
def manifest(packed):
    return read_manifest(packed)


@pytest.fixture(scope="module")
def f(packed) -> Facts:
    return facts(packed)


# -- staging slots: auto ------------------------------------------------------------------------------


@pytest.mark.parametrize("part_bytes,fraction,want", [(None, 0.25, 1), (None, 0.5, 3), (None, 0.75, 5), (None, 0.95, 7),
                                                      ("2 experts", 0.95, 4), ("3 experts", 0.95, 6)])
def test_auto_staging_is_two_per_routed_expert_in_at_most_half_the_budget(f, manifest, fraction, want, part_bytes, monkeypatch):
    """top-2 model: auto wants 4 staging slots, or up to 8 so that a half carries
    ``AUTO_PART_BYTES`` of transfer (these experts are far smaller: 8), takes at most half the
    budget, at least one."""
    assert f.top_k == 2
    if part_bytes is not None:  # a part of that many INT8 blobs: 4 slots for 2, 6 for 3
        monkeypatch.setattr(placement, "AUTO_PART_BYTES", int(part_bytes.split()[0]) * f.stride["int8"])
    cfg = parse_config({"tiers": {"gpu": {"fraction": fraction}}})
    assert cfg.gpu.staging_slots == "auto"
    budget = int(fraction * 24 * f.slot)
    wanted = {None: 8, "2 experts": 4, "3 experts": 6}[part_bytes]
    assert want == max(1, min(wanted, budget // (f.slot + f.stride["int8"]) // 2))  # the rule, spelled out for these cases
    assert plan_placement(cfg, manifest).groups[0].staging == want
    check(f, manifest, cfg, expect(f, cfg))


@pytest.mark.parametrize("fraction,want", [(0.25, 1), (0.5, 4), (0.75, 6), (0.95, 6)])
def test_auto_staging_is_three_per_routed_expert_where_experts_are_too_large_to_stack(f, manifest, fraction, want, monkeypatch):
    """The int8 blobs counted as too large to stack (and a part's bytes asking for no more than
    the 4 slots a top-2 model gets anyway): two transit rows, and auto wants 6 staging slots, within
    half the budget counted with those two rows."""
    monkeypatch.setattr(placement, "STACK_BYTES", f.nbytes["int8"] - 1)
    monkeypatch.setattr(placement, "AUTO_PART_BYTES", 2 * f.stride["int8"])
    cfg = parse_config({"tiers": {"gpu": {"fraction": fraction}}})
    budget = int(fraction * 24 * f.slot)
    fit = max(n for n in range(1, 7) if n * f.slot + min(n, 2) * f.stride["int8"] <= budget // 2)
    assert want == fit  # the rule, spelled out for these cases
    (g,) = plan_placement(cfg, manifest).groups
    assert (g.staging, g.transit_rows) == (want, min(want, 2))
    check(f, manifest, cfg, expect(f, cfg))


def _carry(packed, text: str | None) -> None:
    """Write the packed config.json as ``text`` (None: carry none) and re-seal the manifest's record of it."""
    import zlib

    from tiers.loader.manifest_parse import checksum

    doc = json.loads((packed / "manifest.json").read_text())
    if text is None:
        (packed / "config.json").unlink()
        del doc["carried"]["config.json"]
    else:
        (packed / "config.json").write_text(text)
        doc["carried"]["config.json"] = {"crc32": zlib.crc32(text.encode()), "nbytes": len(text.encode())}
    doc["checksum"] = checksum(doc)
    (packed / "manifest.json").write_text(json.dumps(doc))


def test_auto_staging_reads_top_k_from_the_packed_config(f, manifest, tmp_path):
    import shutil

    from tiers.policy.placement import top_k

    assert top_k(manifest) == 2
    packed = tmp_path / "p"
    shutil.copytree(manifest.root, packed)
    for text, k in [("{}", 1), ('{"text_config": {"num_experts_per_tok": 8}}', 8), ("[]", 1), ('{"text_config": [8]}', 1),
                    ("[" * 5000 + "]" * 5000, 1), (None, 1)]:  # no num_experts_per_tok, or no config: one
        _carry(packed, text)
        assert top_k(read_manifest(packed)) == k, text


@pytest.mark.parametrize("change", ["edit", "fifo"])
def test_top_k_reads_only_the_checked_config(manifest, tmp_path, change):
    """A config.json that differs from the manifest's record is refused, naming it; a FIFO in its
    place is refused too, never opened to wait for a writer (a load used to hang there)."""
    import os
    import shutil

    from tiers.loader.pack_files import IntegrityError
    from tiers.policy.placement import top_k

    packed = tmp_path / "p"
    shutil.copytree(manifest.root, packed)
    if change == "edit":
        (packed / "config.json").write_text('{"num_experts_per_tok": 8}')
    else:
        (packed / "config.json").unlink()
        os.mkfifo(packed / "config.json")
    with pytest.raises(IntegrityError, match=r"carried file '.*config\.json' (differs from the manifest|is not a regular file)"):
        top_k(read_manifest(packed))
