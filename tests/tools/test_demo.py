"""tools/demo.py: prints the generated text and whether it matches the untiered model, and leaves
no temporary directory behind."""
from __future__ import annotations

import ast
import importlib
import re
import tempfile

import pytest

demo = importlib.import_module("tiers.tools.demo")


def _texts(out: str, label: str) -> list[str]:
    """The string literals printed after ``label`` (a regular expression)."""
    return [ast.literal_eval(m) for m in re.findall(rf"{label}\s*('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")", out)]


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """tempfile's directory for the test: whatever the demo leaves there is seen."""
    root = tmp_path / "temp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_demo_prints_text_that_matches_the_untiered_model(temp_root, capsys):
    assert demo.main(["--device", "cpu", "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    (int8,) = _texts(out, r"generated 12 tokens on cpu in [\d.]+ s:")
    (untiered,) = _texts(out, "untiered:")
    (exact,) = _texts(out, "tiers, every tier in bf16:")
    for text in (int8, untiered, exact):
        assert isinstance(text, str) and len(text) == 12 and text.isprintable() and text.isascii(), text
    assert exact == untiered
    assert "matches the untiered model: yes (bf16 tiers must match token for token)" in out
    assert re.search(r"the INT8 tiers of step 4 match it: (yes|no, the first \d+ of 12 tokens agree)", out)
    work = re.search(r"^working in (\S+) \(a temporary directory, removed at the end\)$", out, re.M).group(1)
    assert work.startswith(str(temp_root)) and f"removed {work}" in out
    assert list(temp_root.iterdir()) == []


def test_demo_keeps_its_workdir_and_says_so(temp_root, tmp_path, capsys):
    work = tmp_path / "work"
    assert demo.main(["--device", "cpu", "--tokens", "4", "--workdir", str(work), "--no-check"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in work.iterdir()) == ["hf", "packed", "tiers.yaml"]
    assert f"kept in {work}: hf, packed, tiers.yaml" in out and "matches" not in out
    assert list(temp_root.iterdir()) == []


def test_demo_on_an_existing_checkpoint(temp_root, checkpoint_factory, capsys):
    src = checkpoint_factory("qwen3_moe")  # vocabulary 256 and no tokenizer: byte-level
    before = sorted(p.name for p in src.iterdir())
    assert demo.main(["--device", "cpu", "--tokens", "6", "--model", str(src)]) == 0
    out = capsys.readouterr().out
    assert f"1. the checkpoint {src}" in out
    assert "matches the untiered model: yes" in out and len(_texts(out, "untiered:")[0]) > 0
    assert sorted(p.name for p in src.iterdir()) == before
    assert list(temp_root.iterdir()) == []


def test_demo_model_without_config_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo.main(["--model", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err


def test_demo_on_a_family_pack_refuses_is_one_line(temp_root, tmp_path, capsys, monkeypatch):
    """A family pack refuses (none today: a stand-in reason on a served one) is one line."""
    from conftest import save_tiny

    src = save_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    monkeypatch.setattr(importlib.import_module("tiers.loader.pack"), "unservable", lambda module: "its experts have no act_fn")
    capsys.readouterr()
    assert demo.main(["--device", "cpu", "--model", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiers-demo: error: qwen3_moe (Qwen3MoeExperts): its experts have no act_fn") and err.count("\n") == 1
    assert list(temp_root.iterdir()) == []


def test_demo_runs_across_processes_under_torchrun(tmp_path):
    """``torchrun --nproc-per-node 2 tools/demo.py --parallel`` on CPUs (gloo): every process's
    tokens agree, and the bf16 tiers still match the untiered model."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(root / "tools" / "demo.py"),
                          "--parallel", "--device", "cpu", "--tokens", "6"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout
    assert "parallel: {experts: true}" in out and "5. tier stats, summed over the 2 processes:" in out
    assert out.count("the 2 processes generated the same tokens: yes") == 2
    assert "matches the untiered model: yes" in out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tiers-demo-")] == []


def test_demo_parallel_outside_torchrun_says_how(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert demo.main(["--parallel", "--device", "cpu"]) == 2
    assert "torchrun --nproc-per-node N tools/demo.py --parallel" in capsys.readouterr().err
