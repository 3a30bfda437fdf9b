"""loader.source_formats: MXFP4 (gpt-oss) and block-scaled FP8 (DeepSeek-V3) checkpoints read as
their decoded bf16 tensors, packed exactly as the bf16 checkpoint of those decoded tensors packs;
fp16 and fp32 checkpoints packed as their bf16 casts; and the ``mxfp4`` precision, which keeps an
MXFP4 source as stored and is refused for any other source.

Each quantized checkpoint is written by the test from a tiny random model, with its "twin": the
same model saved in bf16 with the decoded values, the checkpoint a lossless reader must agree with.
"""
from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import tiers
import tiers.api
from conftest import save_tiny
from tiers.loader import source_formats
from tiers.loader.layout import ExpertKey
from tiers.loader.pack import pack
from tiers.loader.packed import read_manifest
from tiers.loader.source import SourceCheckpoint
from tiers.quant import fp8, mxfp4

pack_module = importlib.import_module("tiers.loader.pack")
FP8_BLOCK = (32, 32)  # cuts the tiny model's 48- and 24-row weights' last blocks short
GPT_OSS = dict(intermediate_size=64)  # the MXFP4 blocks of 32 run along I in down_proj


# -- writing checkpoints -------------------------------------------------------------------------------
def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    """``dst``: ``src``'s carried files, with ``tensors`` as its one shard and ``quantization_config`` in config.json."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def fp8_checkpoint(root: Path, model_type: str = "deepseek_v3") -> tuple[Path, Path]:
    """(every 2-D projection weight as FP8 with weight_scale_inv, as DeepSeek-V3 ships; its bf16 twin)."""
    src = save_tiny(model_type, root / "hf")
    quantized, twin = {}, {}
    for k, v in safetensors.torch.load_file(src / "model.safetensors").items():
        if k.endswith(".weight") and v.dim() == 2 and "proj" in k:
            codes, scale_inv = fp8.encode(v, FP8_BLOCK)
            quantized[k], quantized[k + "_scale_inv"] = codes, scale_inv
            twin[k] = fp8.decode(codes, scale_inv, FP8_BLOCK)
        else:
            quantized[k] = twin[k] = v
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    return _write(src, root / "fp8", quantized, config), _write(src, root / "twin", twin, None)


def mxfp4_checkpoint(root: Path) -> tuple[Path, Path]:
    """(gpt-oss's experts' gate_up_proj and down_proj as MXFP4 blocks and scales, as gpt-oss ships; its bf16 twin)."""
    src = save_tiny("gpt_oss", root / "hf", **GPT_OSS)
    quantized, twin = {}, {}
    for k, v in safetensors.torch.load_file(src / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.encode(mxfp4.decode(*mxfp4.encode(v)))  # in the form encoding keeps byte for byte
            quantized[k + "_blocks"], quantized[k + "_scales"] = blocks, scales
            twin[k] = mxfp4.decode(blocks, scales)
        else:
            quantized[k] = twin[k] = v
    config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                  "model.embed_tokens", "lm_head"]}
    return _write(src, root / "mxfp4", quantized, config), _write(src, root / "twin", twin, None)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory) -> tuple[Path, Path]:
    return fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory) -> tuple[Path, Path]:
    return mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"))


@pytest.fixture
def gpt_oss_packs(monkeypatch):
    """Let gpt_oss past pack's and load's refusal: its experts pack and load; only its forward needs what it lacks."""
    monkeypatch.setattr(pack_module, "unservable", lambda module: None)
    monkeypatch.setattr(tiers.api, "unservable", lambda module: None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _same_packs(a: Path, b: Path, precisions) -> None:
    """Every expert blob of every precision byte for byte, and every dense tensor, equal."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert sorted(ma.layers) == sorted(mb.layers)
    for L, entry in ma.layers.items():
        for e in range(entry.layout.num_experts):
            for p in precisions:
                ra, rb = ma.ref(ExpertKey(L, e), p), mb.ref(ExpertKey(L, e), p)
                assert (ra.crc32, ra.nbytes, ra.sqnr_db) == (rb.crc32, rb.nbytes, rb.sqnr_db), f"layer {L} expert {e} {p}"
    dense_a = {k: v for f in ma.dense_files for k, v in safetensors.torch.load_file(a / f).items()}
    dense_b = {k: v for f in mb.dense_files for k, v in safetensors.torch.load_file(b / f).items()}
    assert dense_a.keys() == dense_b.keys()
    for k in dense_a:
        assert dense_a[k].dtype == dense_b[k].dtype and torch.equal(dense_a[k], dense_b[k]), k


# -- FP8 ---------------------------------------------------------------------------------------------
def test_fp8_source_reads_decoded_under_the_plain_names(fp8_pair):
    quantized, twin = fp8_pair
    source, plain = SourceCheckpoint(quantized), SourceCheckpoint(twin)
    assert sorted(source.keys()) == sorted(plain.keys())  # no weight_scale_inv left
    assert source.formats.formats == {"fp8"}
    raw = safetensors.torch.load_file(quantized / "model.safetensors")
    n = 0
    for key in plain.keys():
        assert source.meta(key) == plain.meta(key), key
        got, want = source.get(key), plain.get(key)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
        if key + "_scale_inv" in raw:
            n += 1
            assert raw[key].dtype == torch.float8_e4m3fn and got.dtype == torch.bfloat16
            assert torch.equal(_bits(got), _bits(fp8.decode(raw[key], raw[key + "_scale_inv"], FP8_BLOCK)))
    assert n == 3 * (8 * 3 + 3) + 4 * 4 + 3  # experts and shared experts, attention's q, kv_a, kv_b, o, the dense MLP


def test_fp8_checkpoint_packs_as_its_decoded_twin_and_loads_alike(fp8_pair, tmp_path):
    """Pack reads each FP8 pair decoded: the expert blobs of every precision and the dense weights
    are those of the bf16 twin's pack, and the two packs load to the same logits (the carried
    quantization_config changes nothing)."""
    quantized, twin = fp8_pair
    pack(quantized, tmp_path / "a", precisions=["bf16", "int8"], progress=False)
    pack(twin, tmp_path / "b", precisions=["bf16", "int8"], progress=False)
    _same_packs(tmp_path / "a", tmp_path / "b", ["bf16", "int8"])
    assert "quantization_config" in json.loads((tmp_path / "a" / "config.json").read_text())
    ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
    cfg = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.4}}}
    logits = [tiers.load(tmp_path / d, cfg, device="cpu", progress=False)(ids).logits for d in ("a", "b")]
    assert torch.equal(logits[0], logits[1])


def test_each_pair_is_decoded_once_one_tensor_at_a_time(fp8_pair, mxfp4_pair, tmp_path, monkeypatch, gpt_oss_packs):
    """A pack decodes every FP8 pair once, and every MXFP4 expert's slice once: never a whole
    fused tensor, so decoding holds one tensor (or one expert's slice) at a time."""
    calls = []

    def counting(fn):
        def run(first, second, *args):
            out = fn(first, second, *args)
            calls.append(out.numel())
            return out
        return run

    monkeypatch.setattr(source_formats.fp8, "decode", counting(fp8.decode))
    monkeypatch.setattr(source_formats.mxfp4, "decode", counting(mxfp4.decode))
    quantized, _ = fp8_pair
    pack(quantized, tmp_path / "a", precisions=["bf16"], progress=False)
    raw = safetensors.torch.load_file(quantized / "model.safetensors")
    pairs = [k for k in raw if k.endswith("_scale_inv")]
    assert sorted(calls) == sorted(raw[k.removesuffix("_scale_inv")].numel() for k in pairs)
    calls.clear()
    quantized, twin = mxfp4_pair
    pack(quantized, tmp_path / "b", precisions=["bf16"], progress=False)
    experts = {k: v for k, v in safetensors.torch.load_file(twin / "model.safetensors").items() if k.endswith("_proj")}
    assert sorted(calls) == sorted(v[0].numel() for v in experts.values() for _ in range(v.shape[0]))


def test_pairs_split_across_shards_read_decoded(fp8_pair, tmp_path):
    """A weight and its weight_scale_inv in different shards (through the index) read as one tensor."""
    quantized, twin = fp8_pair
    tensors = safetensors.torch.load_file(quantized / "model.safetensors")
    dst = _write(quantized, tmp_path / "sharded", {}, None)
    (dst / "model.safetensors").unlink()
    shards = {"a.safetensors": {k: v for k, v in tensors.items() if not k.endswith("_scale_inv")},
              "b.safetensors": {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}}
    for name, part in shards.items():
        safetensors.torch.save_file(part, dst / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    source, plain = SourceCheckpoint(dst), SourceCheckpoint(twin)
    key = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert source.key_to_file[key] == "a.safetensors" and key + "_scale_inv" not in source.key_to_file
    assert torch.equal(_bits(source.get(key)), _bits(plain.get(key)))


@pytest.mark.parametrize("damage, says", [
    (lambda t: t.update({"model.layers.1.mlp.experts.3.up_proj.weight_scale_inv": torch.ones(2, 1)}),
     "FP8 pair 'model.layers.1.mlp.experts.3.up_proj.weight' (F8_E4M3 [48, 64], in 'model.safetensors') and "
     "'model.layers.1.mlp.experts.3.up_proj.weight_scale_inv' (F32 [2, 1], in 'model.safetensors'): expected a "
     "float8_e4m3fn weight and fp32 weight_scale_inv of one entry per 32x32 block, [2, 2]"),
    (lambda t: t.update({"model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(48, 64, dtype=torch.bfloat16)}),
     "FP8 pair 'model.layers.1.mlp.experts.3.up_proj.weight' (BF16 [48, 64], in 'model.safetensors')"),
], ids=["scale_grid", "weight_dtype"])
def test_a_bad_fp8_pair_is_refused_naming_its_tensors_and_shard(fp8_pair, tmp_path, damage, says):
    quantized, _ = fp8_pair
    tensors = safetensors.torch.load_file(quantized / "model.safetensors")
    damage(tensors)
    bad = _write(quantized, tmp_path / "bad", tensors, None)
    with pytest.raises(ValueError) as e:
        pack(bad, tmp_path / "packed", progress=False)
    assert str(e.value).startswith(says)
    assert not (tmp_path / "packed").exists()


def test_a_bad_block_size_is_refused_naming_config_json(fp8_pair, tmp_path):
    quantized, _ = fp8_pair
    bad = tmp_path / "bad"
    shutil.copytree(quantized, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        SourceCheckpoint(bad)
    assert str(e.value) == f"{str(bad / 'config.json')!r}: quantization_config.weight_block_size [128] is not two positive integers"


# -- fp16 and fp32 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_checkpoints_pack_and_load_as_their_bf16_casts(dtype, tmp_path):
    """Experts are cast to bf16 when encoded (the blobs equal the bf16 cast's), dense weights keep
    the source's dtype in the pack and are cast when loaded: both load to the same logits."""
    src = save_tiny("qwen3_moe", tmp_path / "hf")
    tensors = safetensors.torch.load_file(src / "model.safetensors")
    wide = _write(src, tmp_path / "wide", {k: v.to(dtype) for k, v in tensors.items()}, None)
    cast = _write(src, tmp_path / "cast", {k: v.to(dtype).to(torch.bfloat16) for k, v in tensors.items()}, None)
    pack(wide, tmp_path / "a", precisions=["bf16", "int8"], progress=False)
    pack(cast, tmp_path / "b", precisions=["bf16", "int8"], progress=False)
    ma, mb = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    for L, entry in ma.layers.items():
        for e in range(entry.layout.num_experts):
            for p in ("bf16", "int8"):
                assert ma.ref(ExpertKey(L, e), p).crc32 == mb.ref(ExpertKey(L, e), p).crc32, (L, e, p)
    dense = {k: v for f in ma.dense_files for k, v in safetensors.torch.load_file(tmp_path / "a" / f).items()}
    assert {v.dtype for v in dense.values()} == {dtype}
    ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
    cfg = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.4}}}
    logits = [tiers.load(tmp_path / d, cfg, device="cpu", progress=False)(ids).logits for d in ("a", "b")]
    assert torch.equal(logits[0], logits[1])


# -- MXFP4 ---------------------------------------------------------------------------------------------
def test_mxfp4_source_reads_each_expert_decoded_as_transformers_does(mxfp4_pair):
    quantized, twin = mxfp4_pair
    source, plain = SourceCheckpoint(quantized), SourceCheckpoint(twin)
    assert sorted(source.keys()) == sorted(plain.keys())  # no _blocks or _scales left
    assert source.formats.formats == {"mxfp4"}
    raw = safetensors.torch.load_file(quantized / "model.safetensors")
    fused = [k for k in plain.keys() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 2 * 3
    for key in fused:
        assert source.meta(key) == plain.meta(key) == ("BF16", list(plain.get(key).shape))
        theirs = convert_moe_packed_tensors(raw[key + "_blocks"], raw[key + "_scales"], dtype=torch.bfloat16)
        for e in range(8):
            got = source.get_expert(key, e)
            assert torch.equal(_bits(got), _bits(theirs[e])) and torch.equal(_bits(got), _bits(plain.get_expert(key, e))), (key, e)
        assert torch.equal(_bits(source.get(key)), _bits(theirs))
    bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
    assert torch.equal(source.get(bias), raw[bias])


def test_a_nan_scale_is_refused_naming_the_scales(mxfp4_pair, tmp_path):
    quantized, _ = mxfp4_pair
    tensors = safetensors.torch.load_file(quantized / "model.safetensors")
    tensors["model.layers.2.mlp.experts.down_proj_scales"][5, 0, 1] = 255
    bad = _write(quantized, tmp_path / "bad", tensors, None)
    with pytest.raises(ValueError) as e:
        SourceCheckpoint(bad).get_expert("model.layers.2.mlp.experts.down_proj", 5)
    assert str(e.value) == ("MXFP4 scales 'model.layers.2.mlp.experts.down_proj_scales' in 'model.safetensors' hold the byte 255, "
                            "which E8M0 reserves for NaN")


def test_mxfp4_checkpoint_packs_as_its_twin_and_keeps_its_bytes(mxfp4_pair, tmp_path, gpt_oss_packs):
    """bf16 blobs are the twin's; mxfp4 blobs hold the checkpoint's blocks and scales byte for byte
    (biases in bf16), record no SQNR (the encoding is exact) and take 4.25 bits per weight."""
    quantized, twin = mxfp4_pair
    pack(quantized, tmp_path / "a", precisions=["bf16", "mxfp4"], progress=False)
    pack(twin, tmp_path / "b", precisions=["bf16"], progress=False)
    _same_packs(tmp_path / "a", tmp_path / "b", ["bf16"])
    m, raw = read_manifest(tmp_path / "a"), safetensors.torch.load_file(quantized / "model.safetensors")
    for L, entry in m.layers.items():
        blob_layout = entry.blobs["mxfp4"]
        weights = sum(f.spec.numel for f in blob_layout.fields if f.spec.name == "blocks") * 2
        assert sum(f.spec.nbytes for f in blob_layout.fields if f.spec.name != "data") * 8 / weights == 4.25
        for e in range(entry.layout.num_experts):
            ref = m.ref(ExpertKey(L, e), "mxfp4")
            assert ref.sqnr_db is None
            with open(tmp_path / "a" / ref.file, "rb") as f:
                f.seek(ref.offset)
                blob = torch.frombuffer(bytearray(f.read(ref.nbytes)), dtype=torch.uint8)
            views = blob_layout.views(blob)
            prefix = f"{entry.module}."
            for name in ("gate_up_proj", "down_proj"):
                assert torch.equal(views[name].data["blocks"], raw[prefix + name + "_blocks"][e])
                assert torch.equal(views[name].data["scales"], raw[prefix + name + "_scales"][e])
                assert torch.equal(views[name + "_bias"].data["data"], raw[prefix + name + "_bias"][e])


def test_mxfp4_precision_is_refused_for_a_source_that_is_not_mxfp4(fp8_pair, tmp_path):
    quantized, _ = fp8_pair
    with pytest.raises(ValueError) as e:
        pack(quantized, tmp_path / "packed", precisions=["bf16", "mxfp4"], progress=False)
    assert str(e.value) == (
        f"precision 'mxfp4' keeps MXFP4 expert weights as the checkpoint stores them, and source checkpoint {str(quantized)!r} "
        "stores none (no *_blocks with *_scales tensors); choose another precision (bf16, int8)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def mxfp4_packed(mxfp4_pair, tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack_module, "unservable", lambda module: None)
        dst = tmp_path_factory.mktemp("mxfp4-packed") / "packed"
        pack(mxfp4_pair[0], dst, precisions=["bf16", "mxfp4"], progress=False)
    return dst


def test_mxfp4_tiers_stage_the_checkpoints_values(mxfp4_pair, mxfp4_packed, device, gpt_oss_packs):
    """With every tier at mxfp4, hot experts stay MXFP4 on the GPU (its blob pool) and, like warm
    and cold ones, are dequantized when staged: every slot holds the checkpoint's decoded values
    bit for bit; the hot ones moved no bytes between tiers."""
    twin = SourceCheckpoint(mxfp4_pair[1])
    cfg = {"tiers": {"gpu": {"fraction": 0.3, "precision": "mxfp4"}, "cpu": {"fraction": 0.3, "precision": "mxfp4"},
                     "nvme": {"precision": "mxfp4"}}}
    model = tiers.load(mxfp4_packed, cfg, device=device, progress=False)
    mgr = tiers.api.manager_of(model)
    p = mgr.placement
    assert p.gpu_pool and p.warm and p.cold and not p.hot
    checked = 0
    for key in list(p.gpu_pool)[:2] + list(p.warm)[:2] + list(p.cold)[:2]:
        pool = mgr.pool_of[key.layer]
        moved = dict(mgr.stats_.bytes_moved)
        held = mgr.slots.acquire(key)
        mgr.slots.wait_all([held])
        prefix = mgr.manifest.layers[key.layer].module
        for name, got in pool.tensors(held.slot).items():
            want = twin.get_expert(f"{prefix}.{name}", key.expert)
            assert torch.equal(_bits(got.cpu()), _bits(want)), (key, name)
        mgr.slots.release_all([held])
        assert (mgr.stats_.bytes_moved == moved) == (key in p.gpu_pool), key
        checked += 1
    assert checked == 6
    mgr.close()


def test_mxfp4_blobs_dequantize_stacked(mxfp4_pair, mxfp4_packed):
    """Several experts' blobs side by side (as staging stacks small lossy experts in transit rows)
    dequantize in one call into consecutive slots, each as it would alone."""
    twin, m = SourceCheckpoint(mxfp4_pair[1]), read_manifest(mxfp4_packed)
    entry, experts = m.layers[1], [6, 0, 3]
    blob_layout = entry.blobs["mxfp4"]
    rows = torch.zeros((len(experts), blob_layout.stride), dtype=torch.uint8)
    for i, e in enumerate(experts):
        ref = entry.experts[e]["mxfp4"]
        with open(mxfp4_packed / ref.file, "rb") as f:
            f.seek(ref.offset)
            rows[i, : ref.nbytes] = torch.frombuffer(bytearray(f.read(ref.nbytes)), dtype=torch.uint8)
    out = {t.name: torch.full((len(experts), *t.shape), float("nan"), dtype=torch.bfloat16) for t in entry.layout.tensors}
    blob_layout.dequantize_into(rows, out)
    for name, got in out.items():
        for i, e in enumerate(experts):
            assert torch.equal(_bits(got[i]), _bits(twin.get_expert(f"{entry.module}.{name}", e))), (name, e)


def test_mxfp4_model_serves_logits_like_transformers(mxfp4_pair, tmp_path):
    """End to end: the packed MXFP4 gpt-oss at mxfp4 warm and cold gives transformers' logits
    from the same checkpoint decoded (its bf16 twin)."""
    from transformers import AutoModelForCausalLM

    quantized, twin = mxfp4_pair
    pack(quantized, tmp_path / "packed", precisions=["bf16", "mxfp4"], progress=False)
    cfg = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.4, "precision": "mxfp4"}, "nvme": {"precision": "mxfp4"}}}
    model = tiers.load(tmp_path / "packed", cfg, device="cpu", progress=False)
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.bfloat16)
    ref.set_experts_implementation("grouped_mm")
    ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
    assert torch.equal(model(ids).logits, ref(ids).logits)


def test_mxfp4_blocks_that_are_not_a_fused_experts_tensor_are_refused(mxfp4_pair, tmp_path):
    quantized, _ = mxfp4_pair
    tensors = safetensors.torch.load_file(quantized / "model.safetensors")
    key = "model.layers.0.mlp.experts.down_proj"
    tensors[key + "_blocks"], tensors[key + "_scales"] = tensors[key + "_blocks"][0], tensors[key + "_scales"][0]
    bad = _write(quantized, tmp_path / "bad", tensors, None)
    with pytest.raises(ValueError) as e:
        SourceCheckpoint(bad)
    assert str(e.value) == (
        f"MXFP4 pair '{key}_blocks' (U8 [64, 2, 16], in 'model.safetensors') and '{key}_scales' (U8 [64, 2], in "
        "'model.safetensors'): expected a fused experts tensor's uint8 blocks [E, N, G, 16] and uint8 scales [E, N, G]"
    )
