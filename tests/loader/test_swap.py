"""loader.swap: the no-replace rename (renameat2 and the fallback), and the final swap replacing only
what it was given: never something that appeared, nor something put in the place of what it was given."""
from __future__ import annotations

import ctypes
import errno
import importlib
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tiers.loader.swap import Target, claim, rename_noreplace

swap_module = importlib.import_module("tiers.loader.swap")


def _make(path: Path, what: str) -> None:
    if what == "empty_dir":
        path.mkdir()
    elif what == "dir":
        path.mkdir()
        (path / "theirs.txt").write_text("theirs")
    elif what == "file":
        path.write_text("theirs")
    elif what == "symlink":
        (path.parent / "elsewhere").mkdir()
        (path.parent / "elsewhere" / "theirs.txt").write_text("theirs")
        path.symlink_to(path.parent / "elsewhere", target_is_directory=True)
    else:
        assert what == "dangling_symlink"
        path.symlink_to(path.parent / "nowhere")


def _state(path: Path):
    """What is at ``path``, enough to tell it was left untouched."""
    if path.is_symlink():
        return ("symlink", os.readlink(path))
    if path.is_dir():
        return ("dir", sorted((p.name, p.read_text()) for p in path.iterdir()))
    return ("file", path.read_text())


def _no_renameat2(monkeypatch):
    monkeypatch.setattr(swap_module, "_RENAMEAT2", None)


def _renameat2_unsupported(monkeypatch):
    """A filesystem without RENAME_NOREPLACE: renameat2 answers EINVAL, and the fallback runs."""
    def einval(*args):
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(swap_module, "_RENAMEAT2", einval)


RENAMES = {"renameat2": lambda monkeypatch: None, "fallback": _no_renameat2, "unsupported": _renameat2_unsupported}
THINGS = ["empty_dir", "dir", "file", "symlink", "dangling_symlink"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_linux_has_renameat2():
    assert swap_module._RENAMEAT2 is not None, "glibc 2.28+ exports renameat2; without it the fallback's window is open"


@pytest.mark.parametrize("rename", list(RENAMES))
@pytest.mark.parametrize("what", THINGS)
def test_rename_noreplace_refuses_anything_there(tmp_path, monkeypatch, rename, what):
    RENAMES[rename](monkeypatch)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "mine.txt").write_text("mine")
    _make(dst, what)
    before = _state(dst)
    with pytest.raises(FileExistsError) as e:
        rename_noreplace(src, dst)
    assert (e.value.filename, e.value.filename2) == (str(src), str(dst))
    assert _state(dst) == before and (src / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("rename", list(RENAMES))
def test_rename_noreplace_renames_onto_nothing(tmp_path, monkeypatch, rename):
    RENAMES[rename](monkeypatch)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "mine.txt").write_text("mine")
    rename_noreplace(src, dst)
    assert (dst / "mine.txt").read_text() == "mine" and not src.exists()


def test_rename_noreplace_passes_other_errors_on(tmp_path):
    with pytest.raises(FileNotFoundError):
        rename_noreplace(tmp_path / "absent", tmp_path / "dst")
    assert list(tmp_path.iterdir()) == []


# -- claim and place -------------------------------------------------------------------------
def _finished(tmp_path: Path) -> Path:
    tmp = tmp_path / ".packed.tmp-1"
    tmp.mkdir()
    (tmp / "manifest.json").write_text("new")
    return tmp


def _appeared(dst: Path, what: str) -> str:
    return (f"destination {str(dst)!r} {what}; it is left untouched and this pack's output removed: "
            f"pack again (with --overwrite to replace it), or into another directory")


APPEARED = "appeared while this pack ran (something else created it)"
REPLACED = "was replaced while this pack ran (it is no longer what overwrite=True was given to replace)"


def _untouched(path: Path):
    """What is at ``path`` and its inode's change time: a rename (even moved away and back) changes it."""
    time.sleep(0.02)  # past the filesystem's coarse clock tick, so a change now would show
    return _state(path), os.lstat(path).st_ctime_ns


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("what", THINGS)
def test_what_appeared_meanwhile_is_never_replaced(tmp_path, overwrite, what):
    dst = tmp_path / "packed"
    with claim(dst, overwrite=overwrite) as target:
        assert target == Target(dst, None)
        tmp = _finished(tmp_path)
        _make(dst, what)
        before = _untouched(dst)
        with pytest.raises(FileExistsError) as e:
            target.place(tmp)
    assert str(e.value) == _appeared(dst, APPEARED)
    assert _untouched(dst) == before and (tmp / "manifest.json").read_text() == "new"


@pytest.mark.parametrize("how", ["moved_away", "deleted"])
def test_what_replaced_the_original_meanwhile_is_never_removed(tmp_path, how):
    dst = tmp_path / "packed"
    _make(dst, "dir")
    with claim(dst, overwrite=True) as target:
        tmp = _finished(tmp_path)
        if how == "moved_away":
            dst.rename(tmp_path / "moved")
        else:
            shutil.rmtree(dst)  # the pin keeps its inode number from being given to the new one
        dst.mkdir()
        (dst / "newer.txt").write_text("someone else's")
        before = _untouched(dst)
        with pytest.raises(FileExistsError) as e:
            target.place(tmp)
    assert str(e.value) == _appeared(dst, REPLACED)
    assert _untouched(dst) == before == (("dir", [("newer.txt", "someone else's")]), before[1])
    if how == "moved_away":
        assert _state(tmp_path / "moved") == ("dir", [("theirs.txt", "theirs")])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".packed.tmp-1", "packed"] + (["moved"] if how == "moved_away" else []))


@pytest.mark.parametrize("what", THINGS)
def test_what_it_was_given_is_replaced_and_removed(tmp_path, what):
    dst = tmp_path / "packed"
    _make(dst, what)
    left = ["elsewhere", "packed"] if what == "symlink" else ["packed"]
    with claim(dst, overwrite=True) as target:
        target.place(_finished(tmp_path))
    assert _state(dst) == ("dir", [("manifest.json", "new")])
    assert sorted(p.name for p in tmp_path.iterdir()) == left  # a symlink's target is not removed, nor followed
    if what == "symlink":
        assert (tmp_path / "elsewhere" / "theirs.txt").read_text() == "theirs"


def test_replaced_in_the_instant_before_the_rename_is_put_back(tmp_path, monkeypatch):
    """The identity is checked again once moved aside: what was put in place of the original
    between the first check and the rename goes back where it was, not into the removal."""
    dst = tmp_path / "packed"
    _make(dst, "dir")

    def replaced_now(root):  # runs between the first identity check and the rename aside
        dst.rename(tmp_path / "moved")
        dst.mkdir()
        (dst / "newer.txt").write_text("someone else's")

    monkeypatch.setattr(swap_module, "_check_removable", replaced_now)
    with claim(dst, overwrite=True) as target:
        tmp = _finished(tmp_path)
        with pytest.raises(FileExistsError) as e:
            target.place(tmp)
    assert str(e.value) == _appeared(dst, REPLACED)
    assert _state(dst) == ("dir", [("newer.txt", "someone else's")])
    assert _state(tmp_path / "moved") == ("dir", [("theirs.txt", "theirs")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".packed.tmp-1", "moved", "packed"]


def test_what_it_was_given_gone_meanwhile_is_nothing_to_replace(tmp_path):
    dst = tmp_path / "packed"
    _make(dst, "dir")
    with claim(dst, overwrite=True) as target:
        shutil.rmtree(dst)
        target.place(_finished(tmp_path))
    assert _state(dst) == ("dir", [("manifest.json", "new")])
    assert [p.name for p in tmp_path.iterdir()] == ["packed"]


def test_claim_refuses_what_is_there_without_overwrite(tmp_path):
    dst = tmp_path / "packed"
    _make(dst, "dangling_symlink")  # something, even though it leads nowhere
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        with claim(dst, overwrite=False):
            pytest.fail("claimed what is there without overwrite")


def test_a_read_only_directory_inside_is_refused_before_anything_moves(tmp_path, monkeypatch):
    """Simulated (root ignores permissions): a directory under the destination that its entries
    cannot be removed from would leave the swap half done; refused first, nothing moved."""
    dst = tmp_path / "packed"
    (dst / "experts" / "bf16").mkdir(parents=True)
    (dst / "experts" / "bf16" / "layer-0000.safetensors").write_text("old")
    real_access = os.access
    monkeypatch.setattr(swap_module.os, "access",
                        lambda p, mode: False if Path(p) == dst / "experts" else real_access(p, mode))
    with claim(dst, overwrite=True) as target:
        tmp = _finished(tmp_path)
        with pytest.raises(PermissionError) as e:
            target.place(tmp)
    assert str(e.value) == (f"cannot replace destination {str(dst)!r}: {str(dst / 'experts')!r} is read-only, so the pack it "
                            f"holds could not be removed; nothing was changed (make it writable, or pack elsewhere)")
    assert (dst / "experts" / "bf16" / "layer-0000.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".packed.tmp-1", "packed"]
