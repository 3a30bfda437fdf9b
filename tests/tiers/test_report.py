"""tiers.report: the runtime manifest as plain data, the load summary, and tools/inspect.py printing the manifest."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiers
from tiers.api import manager_of
from tiers.store.table import Home

ROOT = Path(__file__).resolve().parents[2]
CFG = {"tiers": {"gpu": {"fraction": 0.3}, "cpu": {"fraction": 0.4, "precision": "int8"}, "nvme": {"precision": "int8"}}}


@pytest.fixture(scope="module")
def model(packed_factory):
    m = tiers.load(packed_factory("qwen3_moe"), CFG, device="cpu", progress=False)
    m.generate(torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0)), max_new_tokens=4, do_sample=False)
    yield m
    manager_of(m).close()


def test_the_manifest_is_plain_data_that_agrees_with_the_table(model):
    mgr = manager_of(model)
    doc = tiers.manifest(model)
    assert json.loads(json.dumps(doc)) == doc  # JSON-serializable as it stands
    assert len(doc["experts"]) == len(mgr.table)
    for e in doc["experts"]:
        r = mgr.table[(e["layer"], e["expert"])]
        assert (e["tier"], e["hot"], e["host_offset"]) == (r.home.value, r.hot, r.host_offset)
        assert e["slot"] == (None if r.slot is None else [mgr.pool_of[e["layer"]].index, r.slot])
        want = {Home.GPU: "bf16", Home.CPU: "int8", Home.NVME: "int8"}[r.home]
        assert e["precision"] == want
        layer = mgr.manifest.layers[e["layer"]]
        assert e["bytes"] == (layer.layout.nbytes() if r.home is Home.GPU else layer.blobs["int8"].stride)
    for p, pool in zip(doc["pools"], mgr.pools):
        assert (p["count"], p["hot"], p["staging"]) == (pool.n_slots, pool.hot, pool.n_slots - pool.hot)
        assert p["dtype"] == "bfloat16" and p["slot_bytes"] * pool.n_slots == pool.nbytes
        assert {t["name"]: t["shape"] for t in p["tensors"]} == {n: list(s.shape[1:]) for n, s in pool.slabs.items()}
        assert [s["occupant"] for s in p["slots"]] == [None if (o := mgr.table.occupant(pool.index, i)) is None else list(o)
                                                      for i in range(pool.n_slots)]
        assert {s["state"] for s in p["slots"]} <= {"free", "reserved", "writing", "ready", "in use"}
    host = doc["host"]
    assert host["capacity"] == mgr.host.capacity and sum(host[k] for k in ("warm", "rings", "uploads") if k in host) == host["used"]
    assert doc["gpu"]["total"] == sum(p.nbytes for p in mgr.pools) + sum(t.numel() for t in mgr.staging.transit.values())
    assert doc["gpu"]["total"] <= doc["gpu"]["budget"]
    assert set(doc["gpu"]["outside_budget"]) == {"step_graph_kv_cache", "direct_tables"}


def test_the_manifest_checks_the_table_first(model):
    """A table whose records drift apart is reported, not dumped."""
    mgr = manager_of(model)
    hot = next(k for k, r in mgr.table.items() if r.hot)
    pool = mgr.pool_of[hot.layer].index
    slot = mgr.table[hot].slot
    occupants = mgr.table._pools[pool].occupant
    occupants[slot] = None
    try:
        with pytest.raises(AssertionError, match="names None"):
            tiers.manifest(model)
    finally:
        occupants[slot] = hot


def test_inspect_prints_a_saved_manifest(model, tmp_path):
    doc = tiers.manifest(model)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect.py"), str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == doc["summary"]
    counts = {t: sum(e["tier"] == t for e in doc["experts"]) for t in ("gpu", "cpu", "nvme")}
    for tier, n in counts.items():
        assert any(line.startswith(f"{tier}: {n} experts") for line in lines), (tier, n, lines)
    assert any(line.startswith("pool 0: ") and f"{doc['pools'][0]['count']} slots" in line for line in lines)


def test_the_summary_says_what_the_gpu_budget_bought(model):
    gpu, cpu, nvme = tiers.manifest(model)["summary"]
    mgr = manager_of(model)
    hot = sum(p.hot for p in mgr.pools)
    staging = sum(p.n_slots - p.hot for p in mgr.pools)
    assert gpu.startswith(f"gpu: {hot} hot + {staging} staging slots, ") and f"({hot} of {len(mgr.table)} experts hot)" in gpu
    assert cpu.startswith(f"cpu: {len(mgr.placement.warm)} warm experts (int8)")
    assert nvme.startswith(f"nvme: {len(mgr.placement.cold)} cold experts (int8)")


def test_a_budget_the_staging_slots_take_whole_is_said_at_load(packed_factory, capsys):
    """``gpu.fraction`` buys staging slots first: on a small model 25% can buy no hot expert at all,
    and the load says so (it used to say nothing)."""
    model = tiers.load(packed_factory("qwen3_moe"), {"tiers": {"gpu": {"fraction": 0.1}}}, device="cpu")
    try:
        mgr = manager_of(model)
        assert sum(p.hot for p in mgr.pools) == 0 and sum(p.n_slots for p in mgr.pools) > 0
        err = capsys.readouterr().err
        gpu = next(line for line in err.splitlines() if line.startswith("tiers: gpu: "))
        assert "0 hot + " in gpu and "no expert is hot" in gpu and "raise tiers.gpu.fraction or budget" in gpu
    finally:
        manager_of(model).close()
