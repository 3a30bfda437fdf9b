"""bench/trace_gaps.py on a synthetic chrome trace: busy times as unions of spans, and the copy
stream's gaps with the kernel time and host ranges inside them."""
from __future__ import annotations

import gzip
import json
import sys

import pytest

from bench_script import load

trace_gaps = load("trace_gaps")


def test_union_merges_overlapping_and_touching_spans():
    assert trace_gaps.union_us([]) == 0
    assert trace_gaps.union_us([(0, 10), (5, 10), (20, 5), (25, 5)]) == 15 + 10
    assert trace_gaps.union_us([(30, 1), (0, 2)]) == 3


def _ev(cat, ts, dur, name="x", stream=None):
    e = {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {}}
    if stream is not None:
        e["args"]["stream"] = stream
    return e


@pytest.mark.parametrize("gz", [False, True])
def test_gaps_of_the_busiest_copy_stream(tmp_path, monkeypatch, capsys, gz):
    events = [
        _ev("gpu_memcpy", 1000, 100, stream=13), _ev("gpu_memcpy", 1400, 100, stream=13),  # a 300 us gap
        _ev("gpu_memcpy", 1550, 100, stream=13),  # 50 us: under --min-us
        _ev("gpu_memcpy", 1000, 10, stream=7),  # a quieter copy stream
        _ev("kernel", 1150, 100, stream=7), _ev("kernel", 1200, 100, stream=17),  # 150 us of kernels in the gap
        _ev("user_annotation", 1120, 200, name="tiers.stream_part"), _ev("user_annotation", 1130, 10, name="tiers._fetch"),
    ]
    path = tmp_path / ("t.json.gz" if gz else "t.json")
    data = json.dumps({"traceEvents": events})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    monkeypatch.setattr(sys, "argv", ["trace_gaps", str(path)])
    assert trace_gaps.main() == 0
    out = capsys.readouterr().out
    assert "copy stream 13:" in out
    gaps = [line for line in out.splitlines() if line.strip().startswith(("100-", "0-")) or " us (" in line]
    assert len(gaps) == 1 and "(   300)" in gaps[0] and "kernels    150 us" in gaps[0]
    assert "stream_part" in gaps[0] and "_fetch" not in gaps[0], "only host ranges longer than 30 us are named"
    assert "tiers.stream_part" in out and "idle in those gaps: 0.30 ms" in out
