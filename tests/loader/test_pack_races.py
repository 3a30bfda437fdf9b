"""loader.pack under races and faults: two packs of one destination really overlapping (one wins,
the other is refused by the lock), a destination that someone else creates or replaces while a
pack runs (never deleted), and a full disk or read-only filesystem (nothing left behind)."""
from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disk_faults import WHERE, full_disk, read_only_fs
from tiers.loader.lock import DestinationLocked
from tiers.loader.pack import pack
from tiers.loader.packed import MANIFEST, read_manifest

pack_module = importlib.import_module("tiers.loader.pack")
REPO = Path(__file__).resolve().parents[2]
MODEL = "qwen3_moe"
PRECISIONS = ("bf16", "int8")


def _files(root: Path) -> dict[str, object]:
    """Every file's bytes (the manifest parsed, less the pack's duration and the manifest's checksum,
    which covers that duration): equal for two packs of one source."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
    read_manifest(root)  # the manifest's own checksum holds
    doc = json.loads(out.pop(MANIFEST))
    doc["pack"].pop("seconds")
    doc.pop("checksum")
    out[MANIFEST] = doc
    return out


@pytest.fixture(scope="module")
def reference(checkpoint_factory, tmp_path_factory) -> dict[str, object]:
    """The files of a pack of the model made alone."""
    dst = tmp_path_factory.mktemp("reference") / "packed"
    pack(checkpoint_factory(MODEL), dst, precisions=PRECISIONS, progress=False)
    return _files(dst)


# -- two packs of one destination at once ----------------------------------------------------
# Pack A: it pauses once it holds the lock and has written its dense weights, until told to go on.
PAUSED_PACK = """
import importlib, sys, time
from pathlib import Path
pack_module = importlib.import_module("tiers.loader.pack")
real, sync = pack_module._write_experts, Path(sys.argv[3])
def paused(*args):
    (sync / "paused").touch()
    deadline = time.monotonic() + 120
    while not (sync / "go").exists():
        if time.monotonic() > deadline:
            sys.exit("never told to go on")
        time.sleep(0.01)
    return real(*args)
pack_module._write_experts = paused
pack_module.pack(sys.argv[1], sys.argv[2], precisions=("bf16", "int8"), progress=False)
"""


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, f"pack A ended (status {proc.returncode}) before pausing: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "pack A never paused"
        time.sleep(0.01)


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_concurrent_packs_one_wins_the_other_is_refused(checkpoint_factory, reference, tmp_path, overwrite):
    src = checkpoint_factory(MODEL)
    out, sync = tmp_path / "out", tmp_path / "sync"
    out.mkdir()
    sync.mkdir()
    dst = out / "packed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([sys.executable, "-c", PAUSED_PACK, str(src), str(dst), str(sync)], env=env,
                          stderr=subprocess.PIPE, text=True) as a:
        try:
            _wait_for(sync / "paused", a)  # A holds the lock, mid-pack
            with pytest.raises(DestinationLocked) as e:
                pack(src, dst, precisions=PRECISIONS, overwrite=overwrite, progress=False)
            during = sorted(p.name for p in out.iterdir())
            (sync / "go").touch()
            _, err = a.communicate(timeout=300)
        finally:
            if a.poll() is None:
                a.kill()
    assert a.returncode == 0, err
    assert e.value.pid == a.pid
    assert str(e.value) == (f"destination {str(dst)!r} is being packed by another pack (pid {a.pid}), which holds "
                            f".packed.lock beside it; wait for that pack to end, or pack into another directory")
    assert during == [".packed.lock", f".packed.tmp-{a.pid}"]  # B created nothing and removed nothing of A's
    assert [p.name for p in out.iterdir()] == ["packed"]
    assert read_manifest(dst).precisions == PRECISIONS and len(read_manifest(dst).keys) == 24
    assert _files(dst) == reference  # A's pack, complete: every file as a pack made alone writes it


# -- a destination someone else makes while a pack runs --------------------------------------
def _meanwhile(monkeypatch, act) -> None:
    """Run ``act`` while the pack writes its experts (after it checked its destination)."""
    real = pack_module._write_experts

    def acting(*args):
        act()
        return real(*args)

    monkeypatch.setattr(pack_module, "_write_experts", acting)


def _theirs(dst: Path, what: str) -> None:
    if what == "empty_dir":
        dst.mkdir()
    elif what == "dir":
        dst.mkdir()
        (dst / "theirs.txt").write_text("theirs")
    else:
        dst.write_text("theirs")


def _state(path: Path):
    return sorted((p.name, p.read_text()) for p in path.iterdir()) if path.is_dir() else path.read_text()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("what", ["empty_dir", "dir", "file"])
def test_a_destination_that_appears_meanwhile_is_never_deleted(checkpoint_factory, tmp_path, monkeypatch, overwrite, what):
    dst = tmp_path / "packed"
    _meanwhile(monkeypatch, lambda: _theirs(dst, what))
    with pytest.raises(FileExistsError) as e:
        pack(checkpoint_factory(MODEL), dst, precisions=("bf16",), overwrite=overwrite, progress=False)
    assert str(e.value) == (f"destination {str(dst)!r} appeared while this pack ran (something else created it); it is "
                            f"left untouched and this pack's output removed: pack again (with --overwrite to replace it), "
                            f"or into another directory")
    assert _state(dst) == {"empty_dir": [], "dir": [("theirs.txt", "theirs")], "file": "theirs"}[what]
    assert [p.name for p in tmp_path.iterdir()] == ["packed"]


def test_a_destination_replaced_meanwhile_is_never_deleted(checkpoint_factory, tmp_path, monkeypatch):
    """overwrite=True replaces what was there when the pack started, nothing put in its place since."""
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    pack(src, dst, precisions=("bf16",), progress=False)
    original = _files(dst)

    def replace():
        dst.rename(tmp_path / "moved")
        _theirs(dst, "dir")

    _meanwhile(monkeypatch, replace)
    with pytest.raises(FileExistsError, match="was replaced while this pack ran") as e:
        pack(src, dst, precisions=PRECISIONS, overwrite=True, progress=False)
    assert str(dst) in str(e.value)
    assert _state(dst) == [("theirs.txt", "theirs")]
    assert _files(tmp_path / "moved") == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved", "packed"]


def test_overwrite_replaces_the_destination_it_was_given(checkpoint_factory, reference, tmp_path):
    dst = tmp_path / "packed"
    _theirs(dst, "dir")
    pack(checkpoint_factory(MODEL), dst, precisions=PRECISIONS, overwrite=True, progress=False)
    assert _files(dst) == reference
    assert [p.name for p in tmp_path.iterdir()] == ["packed"]


# -- a full disk, a file too large, a read-only filesystem: nothing left behind --------------
@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG], ids=["ENOSPC", "EFBIG"])
def test_a_full_disk_leaves_nothing(checkpoint_factory, tmp_path, monkeypatch, code, where):
    fired = full_disk(monkeypatch, code, where)
    with pytest.raises(OSError) as e:
        pack(checkpoint_factory(MODEL), tmp_path / "packed", precisions=PRECISIONS, progress=False)
    assert e.value.errno == code and fired, "the fault did not strike"
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_keeps_the_pack_it_was_to_replace(checkpoint_factory, tmp_path, monkeypatch):
    src, dst = checkpoint_factory(MODEL), tmp_path / "packed"
    pack(src, dst, precisions=("bf16",), progress=False)
    before = _files(dst)
    fired = full_disk(monkeypatch, errno.ENOSPC, "experts")
    with pytest.raises(OSError, match="No space left on device"):
        pack(src, dst, precisions=PRECISIONS, overwrite=True, progress=False)
    assert fired and _files(dst) == before
    assert [p.name for p in tmp_path.iterdir()] == ["packed"]


def test_a_read_only_filesystem_leaves_nothing(checkpoint_factory, tmp_path, monkeypatch):
    fired = read_only_fs(monkeypatch, tmp_path)
    with pytest.raises(OSError) as e:
        pack(checkpoint_factory(MODEL), tmp_path / "packed", progress=False)
    assert e.value.errno == errno.EROFS and fired == [str(tmp_path / ".packed.lock")]
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, error, says", [
    ({"device": "nonsense"}, ValueError, "device 'nonsense' cannot quantize experts (Expected one of cpu, cuda"),
    ({"precisions": ()}, ValueError, "precisions is empty: pass at least one, e.g. ['bf16']"),
    ({"precisions": "bf16"}, TypeError, "precisions 'bf16': pass a list of precision names, e.g. ['bf16']"),
], ids=["device", "no_precisions", "precisions_a_string"])
def test_bad_arguments_are_refused_before_anything_is_written(checkpoint_factory, tmp_path, kwargs, error, says):
    with pytest.raises(error) as e:
        pack(checkpoint_factory(MODEL), tmp_path / "packed", progress=False, **kwargs)
    assert str(e.value).startswith(says)
    assert list(tmp_path.iterdir()) == []
