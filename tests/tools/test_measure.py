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


def test_expert_bytes_and_the_ab_config():
    """``expert_bytes_of`` counts the 3-D parameters only; ``warm_config`` reads a spec's fields."""
    import torch

    from tiers.config import load_config
    from tools.measure import expert_bytes_of, warm_config

    model = torch.nn.Module()
    model.experts = torch.nn.Parameter(torch.zeros(4, 3, 2, dtype=torch.bfloat16))
    model.norm = torch.nn.Parameter(torch.zeros(5))
    assert expert_bytes_of(model) == 4 * 3 * 2 * 2
    cfg = load_config(warm_config("int8", "32", "1", 0.25))
    assert (cfg.gpu.size.fraction, cfg.gpu.staging_slots, cfg.gpu.prefetch_depth, cfg.cpu.precision) == (0.25, 32, 1, "int8")
    assert load_config(warm_config("bf16", "auto", "0", 0.5)).gpu.staging_slots == "auto"
