"""loader.pack: per-expert, sharded and fused checkpoints -> the packed format, checked against
the model transformers itself loads from the same source; and the atomicity of the write."""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tiers import quant
from conftest import MODELS, tiny_config
from tiers.loader.destination import StaleDir
from tiers.loader.layout import ExpertKey, find_experts_modules
from tiers.loader.pack import pack
from tiers.loader.packed import MANIFEST, read_manifest

PRECISIONS = ("bf16", "int8")
BLOB_ALIGN = 4096  # the format promises 4 KiB aligned blobs and data section
# The module (``loader.pack`` the attribute is the function re-exported by loader/__init__.py).
pack_module = importlib.import_module("tiers.loader.pack")


# -- helpers ---------------------------------------------------------------------------------
def _read_bytes(root: Path, file: str, offset: int, nbytes: int) -> bytes:
    with open(root / file, "rb") as f:
        f.seek(offset)
        raw = f.read(nbytes)
    assert len(raw) == nbytes, f"{file}: short read at offset {offset}"
    return raw


def _decode(manifest, key, precision: str, raw: bytes) -> dict[str, torch.Tensor]:
    layout = manifest.layers[key.layer].layout
    blob = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = {t.name: torch.empty(t.shape, dtype=torch.bfloat16) for t in layout.tensors}
    manifest.blob(key, precision).dequantize_into(blob, out)
    return out


def _reference(src: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)


def check_packed(src: Path, dst: Path, precisions=PRECISIONS) -> None:
    """Every invariant of a pack of ``src``, against the model transformers loads from ``src``."""
    ref = _reference(src)
    ref_experts = find_experts_modules(ref)
    assert ref_experts, "the reference model has no experts modules"
    manifest = read_manifest(dst)
    doc = json.loads((dst / MANIFEST).read_text())

    # The manifest lists every MoE layer, under the model's module name, with every expert.
    assert sorted(manifest.layers) == sorted(ref_experts)
    assert sorted(e["layer"] for e in doc["layers"]) == sorted(ref_experts)
    assert list(manifest.precisions) == list(precisions)
    for L, (name, mod) in ref_experts.items():
        entry = manifest.layers[L]
        assert entry.module == name
        assert entry.layout.num_experts == mod.num_experts == len(entry.experts)
        raw_entry = next(e for e in doc["layers"] if e["layer"] == L)
        assert sorted(x["expert"] for x in raw_entry["experts"]) == list(range(mod.num_experts))
        want = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if mod.has_bias else set())
        assert {t.name for t in entry.layout.tensors} == want
        assert (entry.layout.has_bias, entry.layout.is_transposed) == (mod.has_bias, mod.is_transposed)

    for L, (name, mod) in ref_experts.items():
        for e in range(mod.num_experts):
            key = ExpertKey(L, e)
            for p in precisions:
                r = manifest.ref(key, p)
                assert r.offset % BLOB_ALIGN == 0, f"{key} {p}: offset {r.offset} not 4 KiB aligned"
                raw = _read_bytes(dst, r.file, r.offset, r.nbytes)
                assert zlib.crc32(raw) == r.crc32, f"{key} {p}: crc32 differs from the manifest"
                got = _decode(manifest, key, p, raw)
                want = {t: getattr(mod, t)[e].detach() for t in got}
                weights = ("gate_up_proj", "down_proj")
                for t in got:
                    if p == "bf16" or t not in weights:  # biases are kept exact in every precision
                        assert torch.equal(got[t], want[t]), f"{key} {p}: {t} differs"
                if p == "bf16":
                    assert r.sqnr_db is None
                else:
                    assert r.sqnr_db is not None and r.sqnr_db > 30, f"{key} {p}: sqnr {r.sqnr_db}"
                    # The recorded SQNR is the real one of the stored blob (min over the weights).
                    real = min(quant.sqnr_db(want[t], got[t]) for t in weights)
                    assert abs(real - r.sqnr_db) < 0.01

    # Expert files are valid safetensors; each tensor expert.{e} is exactly the blob at (offset, stride).
    for L, entry in manifest.layers.items():
        for p in precisions:
            rel = entry.experts[0][p].file
            path = dst / rel
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
            assert (8 + header_len) % BLOB_ALIGN == 0, f"{rel}: data section does not start on 4 KiB"
            stride = entry.blobs[p].stride
            with safe_open(path, framework="pt") as f:
                assert sorted(f.keys()) == sorted(f"expert.{e}" for e in range(entry.layout.num_experts))
                for e, refs in enumerate(entry.experts):
                    assert refs[p].file == rel
                    t = f.get_tensor(f"expert.{e}")
                    assert t.dtype == torch.uint8 and tuple(t.shape) == (stride,)
                    raw = _read_bytes(dst, rel, refs[p].offset, refs[p].nbytes)
                    assert t[: refs[p].nbytes].numpy().tobytes() == raw

    # Dense weights: every non-expert weight, under the model's own names, equal to the model's.
    expert_params = {f"{name}.{t.name}" for L, (name, _) in ref_experts.items() for t in manifest.layers[L].layout.tensors}
    ref_sd = {k: v for k, v in ref.state_dict().items() if k not in expert_params}
    dense: dict[str, torch.Tensor] = {}
    for fname, info in manifest.dense_files.items():
        assert (dst / fname).stat().st_size == info["nbytes"]
        dense.update(safetensors.torch.load_file(dst / fname))
    assert set(dense) == set(ref_sd)
    for k, v in dense.items():
        assert torch.equal(v, ref_sd[k]), k

    # Non-weight files are carried through unchanged.
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert (dst / "config.json").is_file()


# -- every architecture's own checkpoint (per-expert keys; GPT-OSS's fused) ------------------
@pytest.mark.parametrize("model_type", list(MODELS))
def test_pack_per_expert_checkpoint(model_type, checkpoint_factory, packed_factory):
    src = checkpoint_factory(model_type)
    with safe_open(src / "model.safetensors", framework="pt") as f:
        keys = list(f.keys())
    if model_type == "mixtral":
        assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in keys)
        assert any(".block_sparse_moe.experts.0.w3.weight" in k for k in keys)
    elif model_type == "gpt_oss":  # fused, transposed, with biases
        assert any(k.endswith(".mlp.experts.gate_up_proj") for k in keys) and any(k.endswith(".mlp.experts.down_proj_bias") for k in keys)
    else:
        assert any(".experts.0.gate_proj.weight" in k for k in keys)
        assert any(".experts.0.up_proj.weight" in k for k in keys)
    assert (src / "generation_config.json").is_file()
    dst = packed_factory(model_type, PRECISIONS)
    check_packed(src, dst)
    assert (dst / "generation_config.json").is_file()
    assert read_manifest(dst).skipped_keys == ()


def test_pack_sharded_checkpoint(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe", max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    assert len(list(src.glob("model-*.safetensors"))) > 1
    dst = tmp_path / "packed"
    summary = pack(src, dst, precisions=PRECISIONS, progress=False)
    assert summary.experts == 3 * 8 and summary.layers == 3
    assert not (dst / "model.safetensors.index.json").exists()
    check_packed(src, dst)


def test_pack_fused_checkpoint(tmp_path):
    src = tmp_path / "fused"
    src.mkdir()
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    safetensors.torch.save_file(model.state_dict(), src / "model.safetensors")
    model.config.save_pretrained(src)
    with safe_open(src / "model.safetensors", framework="pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    dst = tmp_path / "packed"
    pack(src, dst, precisions=PRECISIONS, progress=False)
    check_packed(src, dst)
    # And the reference really is this model (from_pretrained did not silently re-init).
    m = read_manifest(dst)
    raw = _read_bytes(dst, m.layers[0].experts[5]["bf16"].file, m.layers[0].experts[5]["bf16"].offset,
                      m.layers[0].experts[5]["bf16"].nbytes)
    got = _decode(m, ExpertKey(0, 5), "bf16", raw)
    assert torch.equal(got["gate_up_proj"], model.model.layers[0].mlp.experts.gate_up_proj[5].detach())


# -- atomicity -------------------------------------------------------------------------------
def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_existing_dst_is_refused(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe")
    dst = tmp_path / "packed"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        pack(src, dst, progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    assert not (dst / MANIFEST).exists()
    assert _leftovers(tmp_path, "packed") == []


def test_overwrite_replaces(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe")
    dst = tmp_path / "packed"
    dst.mkdir()
    (dst / "stale.txt").write_text("old")
    pack(src, dst, precisions=("bf16",), overwrite=True, progress=False)
    assert not (dst / "stale.txt").exists()
    assert read_manifest(dst).precisions == ("bf16",)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_pack_leaves_nothing(checkpoint_factory, tmp_path, monkeypatch, exc):
    src = checkpoint_factory("qwen3_moe")
    real = pack_module._write_experts
    seen = {}

    def midway(source, experts, layouts, sources, precisions, out, progress, device):
        first = dict(list(experts.items())[:1])
        real(source, first, layouts, sources, precisions, out, progress, device)  # one layer really written
        seen["files"] = sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors"))
        raise exc("disk on fire")

    monkeypatch.setattr(pack_module, "_write_experts", midway)
    dst = tmp_path / "packed"
    with pytest.raises(exc, match="disk on fire"):
        pack(src, dst, progress=False)
    assert any(f.startswith("experts/") for f in seen["files"]), "the fake did not interrupt midway"
    assert not dst.exists()
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_old_pack(checkpoint_factory, tmp_path, monkeypatch):
    src = checkpoint_factory("qwen3_moe")
    dst = tmp_path / "packed"
    pack(src, dst, precisions=("bf16",), progress=False)
    before = {str(p.relative_to(dst)): p.read_bytes() for p in dst.rglob("*") if p.is_file()}

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pack_module, "_write_experts", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        pack(src, dst, precisions=PRECISIONS, overwrite=True, progress=False)
    after = {str(p.relative_to(dst)): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed"]


def test_missing_shard_names_the_file(checkpoint_factory, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint_factory("qwen3_moe", max_shard_size="100KB"), src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (src / victim).unlink()
    dst = tmp_path / "packed"
    with pytest.raises(FileNotFoundError, match=victim.replace(".", r"\.")):
        pack(src, dst, progress=False)
    assert not dst.exists()
    assert _leftovers(tmp_path, "packed") == []


def test_unknown_precision_is_refused_before_writing(checkpoint_factory, tmp_path):
    dst = tmp_path / "packed"
    with pytest.raises(ValueError, match="fp4"):
        pack(checkpoint_factory("qwen3_moe"), dst, precisions=("bf16", "fp4"), progress=False)
    assert list(tmp_path.iterdir()) == []


# -- destination apart from the source -------------------------------------------------------
def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("relation", ["same", "same_through_dotdot", "same_through_symlink", "inside", "contains"])
def test_destination_overlapping_the_source_is_refused_even_with_overwrite(relation, checkpoint_factory, tmp_path):
    outer = tmp_path / "outer"
    src = outer / "src"
    shutil.copytree(checkpoint_factory("qwen3_moe"), src)
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    dst = {
        "same": src,
        "same_through_dotdot": outer / "elsewhere" / ".." / "src",
        "same_through_symlink": tmp_path / "link",
        "inside": src / "packed",
        "contains": outer,
    }[relation]
    before = _snapshot(outer)
    with pytest.raises(ValueError) as e:
        pack(src, dst, overwrite=True, progress=False)
    msg = str(e.value)
    assert repr(str(dst)) in msg and repr(str(src)) in msg, msg
    what = {"inside": "lies inside the source", "contains": "contains the source"}.get(relation, "is the source")
    assert f"{what} " in msg and "pack into a separate directory" in msg
    assert _snapshot(outer) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "outer"]


def test_destination_beside_the_source_is_packed(checkpoint_factory, tmp_path):
    """A sibling whose name starts with the source's (``src`` and ``src-packed``) is apart from it."""
    src = tmp_path / "src"
    shutil.copytree(checkpoint_factory("qwen3_moe"), src)
    pack(src, tmp_path / "src-packed", precisions=("bf16",), progress=False)
    assert read_manifest(tmp_path / "src-packed").precisions == ("bf16",)


def test_unpacked_directory_hint_names_a_separate_destination(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe")
    with pytest.raises(ValueError, match="not a packed checkpoint") as e:
        read_manifest(src)
    assert f"`python tools/pack.py {src} {src}-packed`" in str(e.value)
    with pytest.raises(ValueError, match="not a packed checkpoint") as e:
        read_manifest(tmp_path)
    assert "DST a new directory, apart from SRC" in str(e.value)


# -- staging directories of dead packs -------------------------------------------------------
DEAD_PID = 2**22 + 1  # above Linux's PID_MAX_LIMIT (2**22): no process can have it


def _staging(parent: Path, name: str, files: dict[str, int]) -> Path:
    d = parent / name
    for rel, size in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(d / rel, "wb") as f:
            f.truncate(size)
    return d


@pytest.mark.skipif(os.name != "posix", reason="PIDs are probed with signal 0, a POSIX call")
def test_stale_staging_of_dead_packs_is_removed_and_reported(checkpoint_factory, tmp_path):
    dst = tmp_path / "packed"
    dead_tmp = _staging(tmp_path, f".packed.tmp-{DEAD_PID}", {"experts/bf16/layer-0000.safetensors": 3 << 20, "config.json": 1 << 19})
    dead_old = _staging(tmp_path, f".packed.old-{DEAD_PID}", {"manifest.json": 1 << 20})
    own = _staging(tmp_path, f".packed.old-{os.getpid()}", {"manifest.json": 10})  # this (running) process's
    other = _staging(tmp_path, f".other.tmp-{DEAD_PID}", {"x": 10})  # another destination's
    odd = _staging(tmp_path, ".packed.tmp-notapid", {"x": 10})
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as child:
        try:
            live = _staging(tmp_path, f".packed.tmp-{child.pid}", {"x": 10})  # a pack still running
            summary = pack(checkpoint_factory("qwen3_moe"), dst, precisions=("bf16",), progress=False)
        finally:
            child.kill()
    assert summary.removed == [StaleDir(dead_old, DEAD_PID, 1 << 20), StaleDir(dead_tmp, DEAD_PID, (3 << 20) + (1 << 19))]
    assert not dead_tmp.exists() and not dead_old.exists()
    assert all(d.is_dir() for d in (own, other, odd, live))
    assert read_manifest(dst).precisions == ("bf16",)
    text = str(summary)
    assert f"removed 2 staging directories that packs no longer running left beside the destination (4.5 MiB): " \
           f".packed.old-{DEAD_PID}, .packed.tmp-{DEAD_PID}" in text


def test_pack_without_stale_staging_reports_none(checkpoint_factory, tmp_path):
    summary = pack(checkpoint_factory("qwen3_moe"), tmp_path / "packed", precisions=("bf16",), progress=False)
    assert summary.removed == [] and "staging" not in str(summary)


def test_stale_staging_is_left_when_the_pack_is_refused(checkpoint_factory, tmp_path):
    """A pack that refuses its arguments changes nothing on disk, stale directories included."""
    dst = tmp_path / "packed"
    dst.mkdir()
    dead = _staging(tmp_path, f".packed.tmp-{DEAD_PID}", {"x": 10})
    with pytest.raises(FileExistsError):
        pack(checkpoint_factory("qwen3_moe"), dst, progress=False)
    assert dead.is_dir()
