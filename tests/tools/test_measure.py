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


class _Owner:
    def step(self, x, first=False):
        return x + 1


def test_steps_time_calls_and_restore_owners():
    from tools.measure import Steps

    steps = Steps()
    inst = _Owner()
    steps.wrap(inst, "step", "inst")  # an instance: the wrapper shadows the class's method
    steps.wrap(_Owner, "step", "cls")  # a class attribute: replaced, then put back
    assert inst.step(1) == 2 and _Owner().step(2) == 3
    assert set(steps.ms) == {"inst", "cls"} and all(v >= 0 for v in steps.ms.values())
    assert steps.calls == {"inst": 1, "cls": 1}
    steps.restore()
    assert "step" not in vars(inst), "the instance kept its wrapper"
    assert _Owner.step.__name__ == "step" and _Owner().step(5) == 6


def test_steps_label_each_call_by_split_and_clear_keeps_the_wrappers():
    from tools.measure import Steps

    obj = _Owner()
    steps = Steps()
    steps.wrap(obj, "step", "unused", split=lambda a, k: "first" if k.get("first") else "other")
    assert obj.step(1) == 2 and obj.step(2, first=True) == 3 and obj.step(3) == 4
    assert steps.calls == {"other": 2, "first": 1} and all(v >= 0 for v in steps.ms.values())
    steps.clear()
    assert not steps.calls and not steps.ms
    obj.step(4)
    assert steps.calls == {"other": 1}
    steps.restore()
    assert "step" not in vars(obj) and obj.step(5) == 6
