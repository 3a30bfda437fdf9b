"""Integrity: a corrupt, truncated or missing packed file raises tiers.IntegrityError naming the
file (and the expert), at load for what load reads and on first read for cold experts; never
wrong weights served silently."""
from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
import torch

from blob_files import corrupt_expert, decoded
from conftest import flip_byte
import tiers
from tiers import report
from tiers.api import manager_of
from tiers.config import load_config
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.policy.placement import plan_placement
from tiers.slots import Slots
from tiers.store.disk_store import DiskStore

MODEL = "qwen3_moe"


def cfg_for(precision: str) -> dict:
    return {"tiers": {"gpu": {"fraction": 0.25}, "cpu": {"fraction": 0.25, "precision": precision},
                      "nvme": {"precision": precision}}}


BF16 = cfg_for("bf16")


@pytest.fixture
def packed_copy(packed_factory, tmp_path) -> Path:
    """A private, writable copy of the session's packed checkpoint."""
    dst = tmp_path / "packed"
    shutil.copytree(packed_factory(MODEL, ("bf16", "int8")), dst)
    return dst


def placement(path: Path, cfg: dict):
    return plan_placement(load_config(cfg), read_manifest(path))


def assert_served_exact(handles, root: Path, precision: str = "bf16") -> None:
    """Each held expert's slot holds exactly its blob in the file, decoded alone."""
    for h in handles:
        want = decoded(root, h.key, precision, next(iter(h.tensors.values())).device)
        for name, t in h.tensors.items():
            assert torch.equal(t, want[name]), (h.key, name)


def assert_names(err: pytest.ExceptionInfo, path: Path, key: ExpertKey | None = None) -> None:
    msg = str(err.value)
    assert str(path) in msg, msg
    if key is not None:
        assert f"layer {key.layer} expert {key.expert}" in msg, msg


# -- control -----------------------------------------------------------------------------------
def test_clean_copy_loads_and_serves_exact_weights(packed_copy):
    pl = placement(packed_copy, BF16)
    assert pl.hot and pl.warm and pl.cold, "the config must put experts in every tier"
    model = tiers.load(packed_copy, BF16, device="cpu", progress=False)
    mgr = manager_of(model)
    for key in (pl.hot[0], pl.warm[0], pl.cold[0]):
        h = mgr.slots.acquire(key)
        mgr.slots.wait_all([h])
        assert_served_exact([h], packed_copy)
        mgr.slots.release_all([h])


# -- expert blobs --------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("tier", ["hot", "warm"])
def test_corrupt_expert_read_at_load_raises(packed_copy, tier, precision):
    cfg = cfg_for(precision)
    pl = placement(packed_copy, cfg)
    key = getattr(pl, tier)[-1]
    stored = "bf16" if tier == "hot" else precision  # hot experts load from the gpu precision (bf16)
    path = corrupt_expert(packed_copy, key, stored)
    with pytest.raises(tiers.IntegrityError) as ei:
        tiers.load(packed_copy, cfg, device="cpu", progress=False)
    assert_names(ei, path, key)
    assert "checksum" in str(ei.value) or "crc32" in str(ei.value)


@pytest.mark.parametrize("where", [0.0, 0.5, 0.999999])
def test_corrupt_cold_expert_raises_on_first_read(packed_copy, where):
    pl = placement(packed_copy, BF16)
    key = pl.cold[len(pl.cold) // 2]
    path = corrupt_expert(packed_copy, key, "bf16", where)
    model = tiers.load(packed_copy, BF16, device="cpu", progress=False)  # cold experts are not read at load
    mgr = manager_of(model)
    with pytest.raises(tiers.IntegrityError) as ei:
        mgr.slots.acquire(key)
    assert_names(ei, path, key)


def test_corrupt_cold_expert_is_never_served_on_retry(packed_copy):
    pl = placement(packed_copy, BF16)
    key = pl.cold[0]
    corrupt_expert(packed_copy, key, "bf16")
    mgr = manager_of(tiers.load(packed_copy, BF16, device="cpu", progress=False))
    with pytest.raises(tiers.IntegrityError):
        mgr.slots.acquire(key)
    with pytest.raises(RuntimeError):  # a second try must fail too, never hand out the half-written slot
        mgr.slots.acquire(key)
    assert mgr.table[key].slot is None
    assert all(r == 0 for p in mgr.pools for r in mgr.table.readers(p.index))
    mgr.table.check()


def test_retry_of_corrupt_cold_expert_raises_integrity_error_again(packed_copy):
    pl = placement(packed_copy, BF16)
    key = pl.cold[0]
    path = corrupt_expert(packed_copy, key, "bf16")
    mgr = manager_of(tiers.load(packed_copy, BF16, device="cpu", progress=False))
    for _ in range(2):
        with pytest.raises(tiers.IntegrityError) as ei:
            mgr.slots.acquire(key)
        assert_names(ei, path, key)



def test_other_experts_still_served_after_an_integrity_error(packed_copy):
    pl = placement(packed_copy, BF16)
    bad, good = pl.cold[0], pl.cold[1]
    corrupt_expert(packed_copy, bad, "bf16")
    mgr = manager_of(tiers.load(packed_copy, BF16, device="cpu", progress=False))
    with pytest.raises(tiers.IntegrityError):
        mgr.slots.acquire(bad)
    h = mgr.slots.acquire(good)
    mgr.slots.wait_all([h])
    assert_served_exact([h], packed_copy)
    mgr.slots.release_all([h])


def test_forward_that_routes_to_a_corrupt_cold_expert_raises(packed_copy):
    pl = placement(packed_copy, BF16)
    root = packed_copy
    files = {corrupt_expert(root, k, "bf16") for k in pl.cold}  # every cold expert: any routing hits one
    model = tiers.load(root, BF16, device="cpu", progress=False)
    prompt = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(tiers.IntegrityError) as ei, torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    msg = str(ei.value)
    m = re.search(r"layer (\d+) expert (\d+)", msg)
    assert m, msg
    assert ExpertKey(int(m[1]), int(m[2])) in set(pl.cold), msg
    assert any(str(f) in msg for f in files), msg


def test_corruption_of_any_field_is_caught(packed_copy):
    """Flip the first and last byte of every field of one blob: each is caught on read."""
    m = read_manifest(packed_copy)
    key = ExpertKey(1, 3)
    for precision in m.precisions:
        ref = m.ref(key, precision)
        spots = sorted({ref.offset + f.offset for f in m.blob(key, precision).fields}
                       | {ref.offset + f.offset + f.spec.nbytes - 1 for f in m.blob(key, precision).fields})
        assert spots[-1] == ref.offset + ref.nbytes - 1
        for off in spots:
            flip_byte(packed_copy / ref.file, off)
            store = DiskStore(read_manifest(packed_copy), [precision])
            with pytest.raises(tiers.IntegrityError) as ei:
                store.read(key, precision, torch.empty(ref.nbytes, dtype=torch.uint8))
            assert_names(ei, packed_copy / ref.file, key)
            store.close()
            flip_byte(packed_copy / ref.file, off)  # restore
        store = DiskStore(read_manifest(packed_copy), [precision])
        store.read(key, precision, torch.empty(ref.nbytes, dtype=torch.uint8))  # restored: clean again
        store.close()


# -- whole files -------------------------------------------------------------------------------
def test_truncated_expert_file_raises_at_load(packed_copy):
    m = read_manifest(packed_copy)
    ref = m.ref(ExpertKey(2, 7), "bf16")
    path = packed_copy / ref.file
    with open(path, "r+b") as f:
        f.truncate(ref.offset + ref.nbytes // 2)  # the last expert's blob is cut in half
    with pytest.raises(tiers.IntegrityError, match="truncated") as ei:
        tiers.load(packed_copy, BF16, device="cpu", progress=False)
    assert_names(ei, path)


def test_missing_expert_file_raises_at_load(packed_copy):
    path = packed_copy / read_manifest(packed_copy).ref(ExpertKey(1, 0), "bf16").file
    path.unlink()
    with pytest.raises(tiers.IntegrityError, match="missing") as ei:
        tiers.load(packed_copy, BF16, device="cpu", progress=False)
    assert_names(ei, path)


def test_expert_file_removed_after_load_raises_on_read(packed_copy):
    pl = placement(packed_copy, BF16)
    key = pl.cold[0]
    path = packed_copy / read_manifest(packed_copy).ref(key, "bf16").file
    m = read_manifest(packed_copy)
    store = DiskStore(m, ["bf16"])  # opens lazily: the size check passes, no fd yet
    path.unlink()
    with pytest.raises(tiers.IntegrityError, match="missing") as ei:
        store.read(key, "bf16", torch.empty(m.ref(key, "bf16").nbytes, dtype=torch.uint8))
    assert_names(ei, path, key)


def _dense_file(root: Path) -> Path:
    files = sorted(read_manifest(root).dense_files)
    assert files
    return root / files[0]


def test_corrupt_dense_file_raises(packed_copy):
    path = _dense_file(packed_copy)
    flip_byte(path, path.stat().st_size // 2)
    with pytest.raises(tiers.IntegrityError) as ei:
        tiers.load(packed_copy, BF16, device="cpu", progress=False)
    assert_names(ei, path)


def test_truncated_dense_file_raises(packed_copy):
    path = _dense_file(packed_copy)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(tiers.IntegrityError) as ei:
        tiers.load(packed_copy, BF16, device="cpu", progress=False)
    assert_names(ei, path)


def test_missing_dense_file_raises(packed_copy):
    path = _dense_file(packed_copy)
    path.unlink()
    with pytest.raises(tiers.IntegrityError, match="missing") as ei:
        tiers.load(packed_copy, BF16, device="cpu", progress=False)
    assert_names(ei, path)


# -- verify="first" / "always" -----------------------------------------------------------------
@pytest.mark.parametrize("verify", ["first", "always"])
def test_verify_mode(packed_copy, verify):
    """A blob changed on disk after its first, checked read is caught on its next read in either
    mode: the change shows in its file's stamp. Another expert, never read before, is checked on
    its first read."""
    m = read_manifest(packed_copy)
    key = ExpertKey(0, 5)
    ref = m.ref(key, "int8")
    store = DiskStore(m, ["bf16", "int8"], verify=verify)
    buf = torch.empty(ref.nbytes, dtype=torch.uint8)
    store.read(key, "int8", buf)  # verified, clean
    path = corrupt_expert(packed_copy, key, "int8")
    with pytest.raises(tiers.IntegrityError) as ei:
        store.read(key, "int8", torch.empty(ref.nbytes, dtype=torch.uint8))
    assert_names(ei, path, key)
    other = ExpertKey(0, 6)
    corrupt_expert(packed_copy, other, "int8")
    with pytest.raises(tiers.IntegrityError):
        store.read(other, "int8", torch.empty(m.ref(other, "int8").nbytes, dtype=torch.uint8))
    store.close()


@pytest.mark.parametrize("verify", ["first", "always"])
def test_what_each_mode_checks_again(packed_copy, verify):
    """``first`` checks a blob again only once its file changed; ``always`` on every read. The
    manifest's CRC is changed in memory, so a check that runs fails and one that does not passes."""
    m = read_manifest(packed_copy)
    key = ExpertKey(1, 3)
    ref = m.ref(key, "int8")
    store = DiskStore(m, ["int8"], verify=verify)
    buf = torch.empty(ref.nbytes, dtype=torch.uint8)
    store.read(key, "int8", buf)
    clean = buf.clone()
    m.layers[1].experts[3]["int8"] = dataclasses.replace(ref, crc32=ref.crc32 ^ 1)  # a check now fails
    if verify == "first":
        store.read(key, "int8", buf)  # the file is as it was: not checked again
        assert torch.equal(buf, clean)
        path = packed_copy / ref.file
        data = path.read_bytes()
        path.write_bytes(data)  # the same bytes: the file's ctime and mtime change, its content not
    with pytest.raises(tiers.IntegrityError, match="checksum mismatch"):
        store.read(key, "int8", buf)
    store.close()


def test_verify_always_through_load(packed_copy):
    pl = placement(packed_copy, BF16)
    key = pl.cold[0]
    mgr = manager_of(tiers.load(packed_copy, BF16, device="cpu", progress=False, verify="always"))
    assert mgr.disk.verify == "always"
    h = mgr.slots.acquire(key)
    mgr.slots.wait_all([h])
    mgr.slots.release_all([h])
    path = corrupt_expert(packed_copy, key, "bf16")
    # Push it out of its staging slot so the next acquire reads the disk again.
    for other in pl.cold[1 : 1 + sum(g.staging for g in pl.groups)]:
        hh = mgr.slots.acquire(other)
        mgr.slots.wait_all([hh])
        mgr.slots.release_all([hh])
    assert mgr.table[key].slot is None
    with pytest.raises(tiers.IntegrityError) as ei:
        mgr.slots.acquire(key)
    assert_names(ei, path, key)


def test_verify_mode_is_validated(packed_copy):
    with pytest.raises(ValueError, match="verify"):
        DiskStore(read_manifest(packed_copy), ["bf16"], verify="sometimes")


def _cold_call(mgr, pl, n: int = 3):
    """A layer whose cold experts give a call of ``n`` cold misses that fits the staging slots."""
    by_layer: dict[int, list[int]] = {}
    for k in pl.cold:
        by_layer.setdefault(k.layer, []).append(k.expert)
    layer, experts = max(by_layer.items(), key=lambda kv: len(kv[1]))
    staging = len(mgr.pool_of[layer].staging)
    return layer, sorted(experts)[: min(n, staging)]


READ_AHEAD = {"tiers": {"gpu": {"fraction": 0.25, "staging_slots": 4}, "cpu": {"fraction": 0.25, "precision": "bf16"},
                         "nvme": {"precision": "bf16"}}}


def _cold_call_manager(root: Path):
    """A CPU manager with reader threads for cold experts, and a layer call of two or more of them."""
    mgr = manager_of(tiers.load(root, READ_AHEAD, device="cpu", progress=False))
    layer, experts = _cold_call(mgr, placement(root, READ_AHEAD))
    assert len(experts) >= 2
    return mgr, layer, experts


def test_cold_misses_of_one_call_are_read_in_parallel_and_served_exact(packed_copy, monkeypatch):
    import threading
    import time

    mgr, layer, experts = _cold_call_manager(packed_copy)
    active, peak, lock = [0], [0], threading.Lock()
    read = mgr.disk.read

    def slow_read(*a, **k):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        try:
            return read(*a, **k)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(mgr.disk, "read", slow_read)
    before = report.stats(mgr)
    mgr.count_call(layer, experts, 1, prefill=False)
    held = mgr.slots.acquire_layer(layer, experts)
    mgr.slots.wait_all(held)
    assert peak[0] >= 2, "the call's cold reads ran one at a time"
    assert_served_exact(held, packed_copy)
    mgr.slots.release_all(held)
    after = report.stats(mgr)
    assert after.hits["nvme"] - before.hits["nvme"] == len(experts), "read-ahead demand misses count as nvme hits"
    assert after.hits["gpu"] == before.hits["gpu"]
    assert after.bytes_moved["nvme"] - before.bytes_moved["nvme"] == sum(mgr.manifest.ref(h.key, "bf16").nbytes for h in held)
    assert after.read_ahead["reads"] - before.read_ahead["reads"] == len(experts)
    assert all(r == 0 for p in mgr.pools for r in mgr.table.readers(p.index)) and not mgr.slots.demand_reads


def test_cold_misses_of_large_blobs_are_read_one_at_a_time(packed_copy, monkeypatch):
    """Blobs above ``PARALLEL_READ_BYTES`` (read in large requests anyway) are not read ahead together."""
    mgr, layer, experts = _cold_call_manager(packed_copy)
    monkeypatch.setattr(Slots, "PARALLEL_READ_BYTES", mgr.manifest.layers[layer].blobs["bf16"].nbytes - 1)
    mgr.count_call(layer, experts, 1, prefill=False)
    held = mgr.slots.acquire_layer(layer, experts)
    mgr.slots.wait_all(held)
    assert report.stats(mgr).read_ahead["reads"] == 0 and not mgr.read_ahead.pending, "large blobs were read ahead"
    assert_served_exact(held, packed_copy)
    mgr.slots.release_all(held)


def test_a_corrupt_blob_among_parallel_cold_reads_raises_and_holds_nothing(packed_copy):
    probe, layer, experts = _cold_call_manager(packed_copy)
    bad = ExpertKey(layer, experts[1])
    path = corrupt_expert(packed_copy, bad, "bf16")
    mgr = manager_of(tiers.load(packed_copy, READ_AHEAD, device="cpu", progress=False))
    with pytest.raises(tiers.IntegrityError) as ei:
        mgr.slots.acquire_layer(layer, experts)
    assert_names(ei, path, bad)
    mgr.slots.drain()
    assert all(r == 0 for p in mgr.pools for r in mgr.table.readers(p.index)), "a failed call left slots held"
    assert mgr.table[bad].slot is None
    assert report.stats(mgr).read_ahead["errors"] == 1, "its read-ahead failed first, then its demand read raised"
    mgr.table.check()
    good = [e for e in experts if e != bad.expert]
    held = mgr.slots.acquire_layer(layer, good)  # the rest are still served, exact
    mgr.slots.wait_all(held)
    assert_served_exact(held, packed_copy)
    mgr.slots.release_all(held)
