"""Expert parallelism (``tiers.parallel``): ranks started as processes of their own (tests/parallel_worker.py)
over gloo on the CPU, and NCCL on two GPUs where there are two; logits and greedy tokens bit-identical
to one process, each rank within its budgets, and a rank's failed load raised on every rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiers
from tiers.parallel import local_counts, local_manifest, shares

from conftest import save_tiny

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "parallel_worker.py"
PROMPT = [[5, 17, 42, 9, 100, 3, 77, 21]]
TOKENS = 6
# every tier in bf16, so that the ranks' answer can equal one process's bit for bit; each rank's
# share of experts spread over its three tiers
TIERS = {"gpu": {"fraction": 0.34}, "cpu": {"fraction": 0.33, "precision": "bf16"}, "nvme": {"precision": "bf16"}}
# every tier INT8 (hot experts kept packed): an expert's values do not depend on which tier holds it
INT8 = {"gpu": {"fraction": 0.34, "precision": "int8"}, "cpu": {"fraction": 0.33}}
PARALLEL = {"tiers": {**TIERS, "parallel": {"experts": True}}}


CASES = [6, 7, "gpt_oss"]  # experts a layer: 2 and 3 ranks divide 6, neither divides 7 (GPT-OSS: 7, transposed, with biases)


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict:
    """Qwen3-MoE packs of 6 experts a layer and 7, and a GPT-OSS one of 7."""
    from tiers.loader.pack import pack

    out = {}
    for case in CASES:
        family, overrides = ("gpt_oss", dict(num_local_experts=7)) if case == "gpt_oss" else ("qwen3_moe", dict(num_experts=case))
        src = save_tiny(family, tmp_path_factory.mktemp(f"hf-ep{case}"), **overrides)
        out[case] = tmp_path_factory.mktemp(f"packed-ep{case}") / "packed"
        pack(src, out[case], precisions=("bf16", "int8"), progress=False)
    return out


def _ranks(world: int, backend: str, cases: list[list[dict]], tmp: Path, timeout: float = 240) -> list[list[dict]]:
    """Start ``world`` worker processes, one a rank; every one must exit within ``timeout`` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs, outs = [], []
    for r in range(world):
        outs.append(tmp / f"rank{r}.pt")
        log = open(tmp / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), backend, str(tmp / "rendezvous"),
                                       str(outs[-1]), json.dumps(cases)], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for r, p in enumerate(procs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{world} ranks did not finish within {timeout} s: a rank hangs")
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        log = (tmp / f"rank{r}.log").read_text()[-3000:]
        assert p.returncode == 0 and outs[r].exists(), f"rank {r} exited {p.returncode} (wrote its results: {outs[r].exists()}): {log}"
    return [torch.load(o) for o in outs]


def _alone(path: Path, tiers_: dict = TIERS) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's prefill logits and greedy tokens, the same tiers without parallelism."""
    model = tiers.load(path, {"tiers": tiers_}, device="cpu", progress=False)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits.float()
    return logits, model.generate(ids, max_new_tokens=TOKENS, do_sample=False)


def _check_rank_budgets(results: list[dict], experts: int, layers: int, spread: bool = True) -> None:
    for r, res in enumerate(results):
        s = res["stats"]
        assert s["residency"]["gpu"]["bytes"] <= s["memory"]["gpu_budget"], f"rank {r} over its gpu budget"
        assert s["residency"]["cpu"]["bytes"] <= s["memory"]["cpu_budget"], f"rank {r} over its cpu budget"
        assert not spread or all(s["residency"][t]["experts"] > 0 for t in ("gpu", "cpu", "nvme")), f"rank {r}: a tier holds none"
    served = sum(res["stats"]["residency"][t]["experts"] for res in results for t in ("gpu", "cpu", "nvme"))
    assert served == experts * layers, "every expert served by exactly one rank"
    starts = shares(experts, len(results))
    for r, res in enumerate(results):  # the runtime manifest names experts by the model's ids
        assert res["parallel"] == {"rank": r, "world": len(results)}
        assert sorted(res["experts"]) == [(L, e) for L in range(layers) for e in range(starts[r], starts[r + 1])]
    total = results[0]["all_ranks"]
    for key in ("hits", "misses", "bytes_moved"):
        for tier, n in total[key].items():
            assert n == sum(res["stats"][key][tier] for res in results), f"all_ranks {key}.{tier} is not the ranks' sum"
    assert all(res["all_ranks"] == total for res in results)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_answer_as_one_process_bit_for_bit(world, packs, tmp_path):
    runs = [(c, TIERS) for c in CASES] + [(7, INT8)]
    cases = [[{"path": str(packs[c]), "config": {"tiers": {**t, "parallel": {"experts": True}}}, "tokens": TOKENS} for c, t in runs]] * world
    results = _ranks(world, "gloo", cases, tmp_path)
    for i, (case, tiers_) in enumerate(runs):
        logits, tokens = _alone(packs[case], tiers_)
        for r in range(world):
            res = results[r][i]
            assert "error" not in res, res.get("error")
            assert torch.equal(res["logits"], logits), f"{case} {tiers_}, rank {r} of {world}: logits differ from one process's"
            assert torch.equal(res["tokens"], tokens), f"{case} {tiers_}, rank {r} of {world}: greedy tokens differ"
        _check_rank_budgets([results[r][i] for r in range(world)], 6 if case == 6 else 7, 3, spread=tiers_ is TIERS)


def test_a_rank_that_fails_to_load_fails_every_rank(packs, tmp_path):
    """Rank 1 names a missing pack, then the two ranks load different checkpoints: both ranks raise, twice."""
    missing = tmp_path / "no-such-pack"
    cases = [[{"path": str(packs[6]), "config": PARALLEL}] * 2,
             [{"path": str(missing), "config": PARALLEL}, {"path": str(packs[7]), "config": PARALLEL}]]
    t0 = time.monotonic()
    results = _ranks(2, "gloo", cases, tmp_path, timeout=120)
    for r in range(2):
        why = results[r][0].get("error", "")
        assert why.startswith("RuntimeError: tiers.load failed on 1 of 2 ranks (rank 1: "), why
        assert "no-such-pack" in why, why
        why = results[r][1].get("error", "")
        assert why.startswith("RuntimeError: tiers.load: the ranks loaded different models"), why
        assert "(0, 6)" in why and "(0, 7)" in why, why
    assert time.monotonic() - t0 < 120


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ranks_answer_as_one_process_over_nccl(packs, tmp_path):
    """The gloo test's twin on two GPUs: tokens as one GPU's (logits compared to within bf16's rounding)."""
    cases = [[{"path": str(packs[7]), "config": PARALLEL, "tokens": TOKENS}]] * 2
    results = _ranks(2, "nccl", cases, tmp_path)
    alone = tiers.load(packs[7], {"tiers": TIERS}, device="cuda:0", progress=False)
    ids = torch.tensor(PROMPT, device="cuda:0")
    tokens = alone.generate(ids, max_new_tokens=TOKENS, do_sample=False).cpu()
    for r in range(2):
        assert torch.equal(results[r][0]["tokens"], tokens), f"rank {r}: greedy tokens differ from one GPU's"
    _check_rank_budgets([results[r][0] for r in range(2)], 7, 3)


def test_shares_are_contiguous_blocks_with_the_remainder_spread():
    assert shares(6, 2) == [0, 3, 6] and shares(6, 3) == [0, 2, 4, 6]
    assert shares(7, 2) == [0, 4, 7] and shares(7, 3) == [0, 3, 5, 7]
    for n in range(1, 40):
        for w in range(1, 9):
            s = shares(n, w)
            sizes = [b - a for a, b in zip(s, s[1:])]
            assert s[0] == 0 and s[-1] == n and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_rank_serves_its_block_numbered_from_zero(packs):
    from tiers.loader.packed import read_manifest

    m = read_manifest(packs[7])
    parts = [local_manifest(m, r, 3) for r in range(3)]
    for L, entry in m.layers.items():
        assert [p.layers[L].layout.num_experts for p in parts] == [3, 2, 2]
        assert sum((p.layers[L].experts for p in parts), ()) == entry.experts
    assert local_counts({0: [1, 2, 3, 4, 5, 6, 7]}, 1, 3) == {0: [4, 5]}


def test_parallel_config_is_checked_at_load(packs):
    with pytest.raises(ValueError, match=r"tiers\.parallel\.experts: true needs torch\.distributed"):
        tiers.load(packs[6], PARALLEL, device="cpu", progress=False)
    with pytest.raises(ValueError, match=r"tiers\.parallel\.experts: expected true or false"):
        tiers.load(packs[6], {"tiers": {"parallel": {"experts": "yes"}}}, device="cpu", progress=False)
    with pytest.raises(ValueError, match=r"tiers\.rebalance\.every_tokens: the rebalancer does not run under tiers\.parallel"):
        tiers.load(packs[6], {"tiers": {"parallel": {"experts": True}, "rebalance": {"every_tokens": 8}}}, device="cpu", progress=False)


def test_a_rank_loads_on_its_own_gpu_by_default(monkeypatch):
    from tiers import parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.default_device() is None  # the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert parallel.default_device() == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    assert parallel.default_device() == torch.device("cuda", 0)
