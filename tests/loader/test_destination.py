"""loader.destination: the process probe behind stale staging, and what is never removed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiers.loader.destination import pid_running, remove_stale, staging_dir, stale_staging

DEAD_PID = 2**22 + 1  # above Linux's PID_MAX_LIMIT (2**22): no process can have it
posix = pytest.mark.skipif(os.name != "posix", reason="PIDs are probed with signal 0, a POSIX call")


@posix
def test_pid_running():
    assert pid_running(os.getpid())
    assert pid_running(1)  # init: another user's (or this user's) process counts as running
    assert not pid_running(DEAD_PID)
    assert not pid_running(0) and not pid_running(-1) and not pid_running(2**63)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: its PID is free (until the system reuses it)
    assert not pid_running(proc.pid)


def test_staging_dir_names(tmp_path):
    dst = tmp_path / "packed"
    assert staging_dir(dst, "tmp") == tmp_path / f".packed.tmp-{os.getpid()}"
    assert staging_dir(dst, "old", 42) == tmp_path / ".packed.old-42"
    with pytest.raises(ValueError, match="'new'"):
        staging_dir(dst, "new")


@posix
def test_a_symlink_or_file_with_a_staging_name_is_never_removed(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    (tmp_path / f".packed.tmp-{DEAD_PID}").symlink_to(mine, target_is_directory=True)
    (tmp_path / f".packed.old-{DEAD_PID}").write_text("a file")
    dst = tmp_path / "packed"
    assert stale_staging(dst) == [] and remove_stale(dst) == []
    assert (mine / "keep.txt").read_text() == "keep"
    assert (tmp_path / f".packed.tmp-{DEAD_PID}").is_symlink() and (tmp_path / f".packed.old-{DEAD_PID}").is_file()


def test_no_parent_no_stale(tmp_path):
    assert stale_staging(tmp_path / "absent" / "packed") == []
