"""loader.lock: one holder per destination, across processes and within one; the message that
names the holder; nothing left beside the destination on any exit; a stale file blocks nothing."""
from __future__ import annotations

import fcntl
import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiers.loader.lock import DestinationLocked, hold, lock_path

lock_module = importlib.import_module("tiers.loader.lock")
REPO = Path(__file__).resolve().parents[2]
DEAD_PID = 2**22 + 1  # above Linux's PID_MAX_LIMIT (2**22): no process can have it


def _message(dst: Path, who: str) -> str:
    return (f"destination {str(dst)!r} is being packed by {who}, which holds .packed.lock beside it; "
            f"wait for that pack to end, or pack into another directory")


def test_a_second_holder_in_this_process_is_refused_then_nothing_is_left(tmp_path):
    dst = tmp_path / "packed"
    assert lock_path(dst) == tmp_path / ".packed.lock"
    with hold(dst) as path:
        assert path.read_text() == f"{os.getpid()} {socket.gethostname()}\n"
        with pytest.raises(DestinationLocked) as e:
            with hold(dst):
                pytest.fail("two holders of one destination's lock")
        assert str(e.value) == _message(dst, f"another pack (pid {os.getpid()})")
        assert (e.value.dst, e.value.lock, e.value.pid) == (dst, path, os.getpid())
        assert isinstance(e.value, OSError) and e.value.errno is None  # the CLI prints it as it is
        assert path.read_text().split()[0] == str(os.getpid())  # the refused one changed nothing
    assert list(tmp_path.iterdir()) == []
    with hold(dst):  # and it is free again
        pass


HOLDER = """
import sys
from pathlib import Path
from tiers.loader.lock import hold
with hold(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_holder_in_another_process_is_named(tmp_path):
    dst = tmp_path / "packed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(dst)], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout.readline() == "held\n"
            with pytest.raises(DestinationLocked) as e:
                with hold(dst):
                    pytest.fail("locked while another process holds it")
            assert e.value.pid == child.pid
            assert str(e.value) == _message(dst, f"another pack (pid {child.pid})")
        finally:
            child.stdin.close()
            child.wait(timeout=60)
    assert child.returncode == 0
    assert list(tmp_path.iterdir()) == []


def test_released_when_the_body_raises(tmp_path):
    dst = tmp_path / "packed"
    with pytest.raises(KeyboardInterrupt):
        with hold(dst):
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with hold(dst):
        pass


def test_a_stale_lock_file_is_reused_and_removed(tmp_path):
    """A pack killed outright leaves its file, whose flock the kernel dropped: it blocks nothing."""
    dst = tmp_path / "packed"
    stale = lock_path(dst)
    stale.write_text(f"{DEAD_PID} gone-host\n")
    inode = stale.stat().st_ino
    with hold(dst) as path:
        assert path.stat().st_ino == inode  # reused, not replaced
        assert path.read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content, who", [
    ("", "another pack (its pid unknown)"),  # locked, its pid not written yet
    ("123 elsewhere\n", "another pack (pid 123 on host elsewhere)"),
    ("garbage", "another pack (its pid unknown)"),
])
def test_the_message_names_what_the_holder_wrote(tmp_path, content, who):
    dst = tmp_path / "packed"
    path = lock_path(dst)
    path.write_text(content)
    with open(path) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DestinationLocked) as e:
            with hold(dst):
                pytest.fail("locked while another holds it")
    assert str(e.value) == _message(dst, who)
    assert path.read_text() == content  # the holder's file, untouched


def test_locking_an_inode_its_holder_just_unlinked_starts_over(tmp_path, monkeypatch):
    """The holder unlinks the file on release: a pack that opened the old inode before that and
    locked it after must not count as holding the lock (a third pack would lock a new file)."""
    dst = tmp_path / "packed"
    real_flock = fcntl.flock
    calls = []

    def released_meanwhile(fd, op):
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:
            os.unlink(lock_path(dst))  # the previous holder's release, between this open and this flock
        return real_flock(fd, op)

    monkeypatch.setattr(lock_module.fcntl, "flock", released_meanwhile)
    with hold(dst) as path:
        monkeypatch.setattr(lock_module.fcntl, "flock", real_flock)
        assert len(calls) == 2 and path.stat().st_ino == calls[1]
        with pytest.raises(DestinationLocked):
            with hold(dst):
                pytest.fail("two holders: one locked an unlinked inode")
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_at_the_lock_name_is_not_followed(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    lock_path(tmp_path / "packed").symlink_to(target)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        with hold(tmp_path / "packed"):
            pytest.fail("locked through a symlink")
    assert target.read_text() == "keep" and lock_path(tmp_path / "packed").is_symlink()


def test_a_lock_file_that_cannot_be_removed_does_not_hide_the_packs_own_error(tmp_path, monkeypatch):
    """A stale file reused in a directory the pack cannot write: the pack fails on its own
    first write, and that error, not the lock file's, is what it raises."""
    dst = tmp_path / "packed"
    real_unlink = os.unlink

    def read_only(path, *args, **kwargs):
        if Path(path) == lock_path(dst):
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(lock_module.os, "unlink", read_only)
    with pytest.raises(RuntimeError, match="the pack's own"):
        with hold(dst):
            raise RuntimeError("the pack's own")
    assert [p.name for p in tmp_path.iterdir()] == [".packed.lock"]  # left: it blocks nothing
    monkeypatch.undo()
    with hold(dst):
        pass
    assert list(tmp_path.iterdir()) == []
