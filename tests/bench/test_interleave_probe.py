"""bench/interleave_probe.py: every condition steps both models for the asked number of steps and
records the allocator's counters around it."""
from __future__ import annotations

import json
import sys

from bench_script import load

probe = load("interleave_probe")


def test_each_condition_times_both_models_step_by_step(tmp_path, monkeypatch):
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["interleave_probe.py", "--layers", "2", "--models", "2", "--steps", "16", "--out", str(out)])
    assert probe.main() == 0
    r = json.loads(out.read_text())
    assert list(r["runs"]) == ["alternate", "blocks", "gcoff", "alternate_again"]
    for name, run in r["runs"].items():
        assert [len(t) for t in run["step_ms"]] == [16, 16] and min(min(t) for t in run["step_ms"]) > 0, name
        assert set(run["allocator_after"]) == set(run["allocator_before"]) and len(run["median_ms"]) == 2
