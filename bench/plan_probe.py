"""Probe: device time of direct decode's slot plan (``quant.direct.plan``'s Triton kernel) per
call, as a step graph runs it: many plans captured back to back in one CUDA graph and replayed.

With ``--old FILE`` (an earlier ``quant/direct_kernel.py``) the same calls also go through that
file's kernel, and every call's slots, destinations, counts and cache state are compared
(``bench/results/plan_probe.json``: the kernel before its loads left the loop, ``git show
d0009dd~1:quant/direct_kernel.py``).

    python bench/plan_probe.py [--old FILE] [--out plan_probe.json]
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

from tiers.quant.direct import SlotCache  # noqa: E402

CALLS = 240  # plans per graph: 20 decode steps of a 12-layer model


def _load(path: str):
    spec = importlib.util.spec_from_file_location("direct_kernel_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(lanes: int, picks: int, rows: int, width: int, seed: int):
    """Per call: its row, resident slots ([width], a quarter of the experts hot) and picks (distinct)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for call in range(CALLS):
        resident = torch.full((width,), -1, dtype=torch.int32)
        hot = torch.randperm(width, generator=g)[: width // 4]
        resident[hot] = torch.arange(hot.numel(), dtype=torch.int32)
        out.append((call % rows, resident.cuda(), torch.randperm(width, generator=g)[:picks].cuda()))
    return out


def _replay_us(graph, reps: int) -> list[float]:
    """Each of ``reps`` replays of ``graph`` timed by events, in us per call of the CALLS it holds."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return times


def measure(kernel, lanes: int, picks: int, rows: int, width: int, reps: int) -> dict:
    calls = _inputs(lanes, picks, rows, width, seed=lanes)
    cache = SlotCache.new(list(range(1000, 1000 + lanes)), rows, width, "cuda")
    ids = torch.zeros(CALLS, picks, dtype=torch.int64, device="cuda")
    counts = torch.zeros(3, dtype=torch.int64, device="cuda")
    usage = torch.zeros(width, dtype=torch.int64, device="cuda")
    dsts = torch.zeros(CALLS, picks, dtype=torch.int32, device="cuda")

    def run_all():
        for i, (row, resident, p) in enumerate(calls):
            kernel.launch_plan(cache, row, resident, p, ids[i], counts, usage)
            dsts[i].copy_(cache.dst[:picks])

    run_all()  # warm-up: compiles, and the relauncher takes over
    run_all()
    torch.cuda.synchronize()
    cache.clear()
    counts.zero_(), usage.zero_()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        run_all()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()  # the first replay's results are compared (from an empty cache)
    torch.cuda.synchronize()
    state = {"ids": ids.cpu(), "dst": dsts.cpu(), "counts": counts.cpu(), "usage": usage.cpu(),
             "owner": cache.owner.cpu(), "stamp": cache.stamp.cpu(), "clock": cache.clock.cpu()}
    times = _replay_us(graph, reps)  # per plan, with its small copy of dst
    # the copies alone, for the part of each call that is not the plan
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph2.capture_begin()
        for i in range(CALLS):
            dsts[i].copy_(cache.dst[:picks])
        graph2.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    copies = _replay_us(graph2, reps)
    return {"us_per_call": statistics.median(times), "us_per_call_min": min(times),
            "copy_us_per_call": statistics.median(copies), "state": state}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="an earlier quant/direct_kernel.py to time and compare against")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    import tiers.quant.direct_kernel as new

    kernels = {"new": new} | ({"old": _load(args.old)} if args.old else {})
    result = {"command": "python bench/plan_probe.py " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(),
              "calls_per_graph": CALLS, "cases": []}
    for lanes, picks, rows, width in [(16, 8, 12, 128), (64, 8, 12, 128), (128, 8, 12, 128), (8, 2, 8, 8)]:
        case = {"lanes": lanes, "picks": picks, "rows": rows, "width": width}
        got = {name: measure(k, lanes, picks, rows, width, args.reps) for name, k in kernels.items()}
        for name, g in got.items():
            case[name] = {k: round(v, 3) for k, v in g.items() if k != "state"}
        if "old" in got:
            case["same_results"] = all(torch.equal(got["new"]["state"][k], got["old"]["state"][k]) for k in got["new"]["state"])
        result["cases"].append(case)
        print(json.dumps(case), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
