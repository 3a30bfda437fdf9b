"""Every MoE family of the installed transformers whose experts go through its experts registry:
packed, loaded through the three tiers in bf16, and bit-identical to transformers' own model.

The families are found in the installed transformers (``families.registry_families``), not
listed here. Each tiny model is saved with ``save_pretrained``, packed, loaded with every tier in
use (gpu, cpu and nvme each hold experts, bf16 everywhere), and its batch-1 prefill logits and
greedy decode steps are compared with ``torch.equal`` against the untiered model running
transformers' default experts implementation. A family Tiers cannot serve is refused at pack,
naming the family and the reason. README's supported-models block is generated from this
classification (``python tests/families.py --write-readme`` rewrites it).
"""
from __future__ import annotations

import importlib

import pytest
import torch
from safetensors import safe_open

import families
import tiers
from tiers.loader.layout import find_experts_modules, unservable
from tiers.loader.pack import pack
from untiered import assert_bit_identical, prompt, reference

BF16_THREE_TIERS = {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.4, "precision": "bf16"},
                              "nvme": {"precision": "bf16"}}}
GEN = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)

FAMILIES = list(families.registry_families())


def _param(model_type: str):
    why = families.NOT_SERVED.get(model_type)
    return pytest.param(model_type, marks=pytest.mark.xfail(reason=why, strict=True)) if why else model_type


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """model_type -> its tiny model's save_pretrained directory; cached for the session."""
    cache = {}

    def make(model_type: str):
        if model_type not in cache:
            path = tmp_path_factory.mktemp(f"hf-{model_type}")
            model = families.tiny_model(model_type)
            try:
                with torch.no_grad():
                    model(prompt("cpu", 1, families.SEQ))
            except Exception as e:  # noqa: BLE001 (whatever transformers raises: the family is out of scope here)
                cache[model_type] = f"{model_type}: the tiny model does not run in transformers itself ({type(e).__name__}: {e})"
            else:
                model.save_pretrained(path)
                cache[model_type] = path
        if isinstance(cache[model_type], str):
            pytest.skip(cache[model_type])
        return cache[model_type]

    return make


def test_the_families_come_from_the_installed_transformers():
    """The enumeration finds the families the tests of the five main ones use, and nothing that
    lacks a registry experts class."""
    found = set(FAMILIES)
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"} <= found
    assert "llama" not in found and "switch_transformers" not in found
    assert len(found) >= 40, sorted(found)


@pytest.mark.parametrize("model_type", [_param(m) for m in FAMILIES])
def test_family_is_bit_identical_through_three_tiers(model_type, family_checkpoint, tmp_path):
    src = family_checkpoint(model_type)
    pack(src, tmp_path / "packed", precisions=["bf16"], progress=False)
    model = tiers.load(tmp_path / "packed", BF16_THREE_TIERS, device="cpu", progress=False)
    held = tiers.stats(model).residency
    assert all(held[tier]["experts"] > 0 for tier in ("gpu", "cpu", "nvme")), held
    ref = reference(src, "cpu")
    _assert_dense_as_transformers_loads(tmp_path / "packed", ref)
    assert_bit_identical(ref, model, prompt("cpu", 1, families.SEQ), GEN)


def test_dense_weights_sit_in_storage_of_their_own(family_checkpoint, tmp_path):
    """Tiers' dense weights on the CPU, and the reference's, are copies torch allocated (64-byte
    aligned), not views at the offsets of a file's bytes: the CPU's float32 matrix-vector kernels
    sum in an order set by the weight's alignment, so HY-V4's float32 lm_head gave decode logits
    2.4e-7 apart from a reference whose weights sat where the safetensors header left them."""
    src = family_checkpoint("hy_v4")
    pack(src, tmp_path / "packed", precisions=["bf16"], progress=False)
    model = tiers.load(tmp_path / "packed", BF16_THREE_TIERS, device="cpu", progress=False)
    experts = {f"{name}." for name, _ in find_experts_modules(model).values()}
    for who, m in (("tiers", model), ("reference", reference(src, "cpu"))):
        dense = {n: p for n, p in m.named_parameters() if not any(n.startswith(e) for e in experts)}
        assert dense and m.lm_head.weight.dtype == torch.float32, who
        odd = {n: p.data_ptr() % 64 for n, p in dense.items() if p.data_ptr() % 64}
        assert not odd, f"{who}: dense weights off 64-byte alignment: {odd}"


def _assert_dense_as_transformers_loads(packed, ref) -> None:
    """Every packed dense tensor equals what ``from_pretrained`` put in the model (renamed and
    converted by the same rules), bit for bit."""
    want = ref.state_dict()
    seen = 0
    for path in sorted(packed.glob("dense-*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                assert key in want, f"packed dense tensor {key!r} is no weight of the model"
                assert torch.equal(t.to(want[key].dtype), want[key]), f"packed dense tensor {key!r} differs from transformers' load"
                seen += 1
    assert seen > 0


def test_pack_refuses_a_family_unservable_names_before_writing(family_checkpoint, tmp_path, monkeypatch):
    """Whatever ``unservable`` refuses, pack refuses at once, naming the family, the experts class
    and the reason, and leaves nothing at the destination."""
    pack_module = importlib.import_module("tiers.loader.pack")  # the module (the package exports the function by that name)
    monkeypatch.setattr(pack_module, "unservable", lambda module: "a reason the forwards cannot run it")
    with pytest.raises(ValueError, match=r"^mixtral \(MixtralExperts\): a reason the forwards cannot run it; "
                                         r"Tiers cannot serve this family yet$"):
        pack(family_checkpoint("mixtral"), tmp_path / "packed", progress=False)
    assert not (tmp_path / "packed").exists()


@pytest.mark.parametrize("model_type", sorted(families.NOT_SERVED))
def test_family_not_served_is_refused_at_pack_naming_it(model_type, family_checkpoint, tmp_path):
    """Pack refuses a family Tiers cannot serve before it writes anything, naming the family and
    the reason ``unservable`` gives."""
    model = families.tiny_model(model_type)
    reasons = {unservable(m) for _, m in find_experts_modules(model).values()} - {None}
    if not reasons:
        pytest.skip(f"{model_type}: no experts module is refused (it fails later: {families.NOT_SERVED[model_type]})")
    with pytest.raises(ValueError, match=rf"^{model_type} \(\w+\): .*Tiers cannot serve this family yet") as e:
        pack(family_checkpoint(model_type), tmp_path / "packed", progress=False)
    assert any(r in str(e.value) for r in reasons)
    assert not (tmp_path / "packed").exists()


def test_readme_lists_the_served_families():
    """README's supported-models block is what this classification generates."""
    have, want = families.readme_block(), families.supported_block()
    assert have == want, f"README's supported-models block is stale; run `python tests/families.py --write-readme`. Expected:\n{want}"
