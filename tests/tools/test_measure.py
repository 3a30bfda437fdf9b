"""tools/measure.py: scratch directories go away with the process, however it ends."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_a_scratch_dir_is_removed_at_exit(ending, tmp_path):
    """A script that fills a scratch directory leaves nothing behind, also when it fails."""
    code = (
        "import sys\n"
        "from tools.measure import scratch_dir\n"
        f"work = scratch_dir('tiers-test-')\n"
        "(work / 'hf').mkdir()\n"
        "(work / 'hf' / 'blob').write_bytes(b'x' * 1024)\n"
        "print(work)\n"
        "sys.stdout.flush()\n"
        + ("raise RuntimeError('the script failed')\n" if ending == "raise" else "")
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "", "TMPDIR": str(tmp_path)})
    assert (done.returncode != 0) == (ending == "raise"), done.stderr
    work = Path(done.stdout.strip().splitlines()[-1])
    assert work.parent == tmp_path and work.name.startswith("tiers-test-")
    assert not work.exists(), f"{work} left behind"
