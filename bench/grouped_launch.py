"""Host time to launch one window's grouped GEMM: transformers' grouped linear against the direct call.

    python bench/grouped_launch.py [--calls 200] [--out bench/results/grouped_launch.json]

A long prefill through the tiers is bound by the host (``bench/prefill_split.py``): each streamed
part launches two grouped GEMMs per window, and transformers' ``_grouped_linear`` checks, before
every GEMM, whether ``torch._grouped_mm`` may run (a device capability query among other Python
steps). ``tiers.integration._window_linear`` makes that choice once per device. This times the
host's time per call of each (no sync inside a round of 200 calls, fewer than CUDA's queue of
pending launches holds, so the host never waits on the device; the queue is drained between rounds) on
Qwen3-30B-A3B's expert shapes, 8 experts and 512 rows, and checks that both give the same bits.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from tiers.tools.measure import write_result  # noqa: E402


def host_us(fn, calls: int, device: torch.device, rounds: int = 10) -> list[float]:
    """Host microseconds per call of ``fn`` over ``calls`` calls, one figure per round."""
    out = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def main(argv: list[str] | None = None) -> int:
    from tiers.integration import _grouped_linear, _kernel_direct, _window_linear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per round (keep under the launch queue's depth)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench/results/grouped_launch.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    n, hidden, inter = 8, 2048, 768  # Qwen3-30B-A3B's experts
    x = torch.randn(args.rows, hidden, generator=g).bfloat16().to(device)
    w = torch.randn(n, hidden, 2 * inter, generator=g).bfloat16().to(device) / hidden**0.5
    offs = torch.linspace(args.rows // n, args.rows, n).round().to(torch.int32).to(device)
    same = torch.equal(_grouped_linear(x, w, offs, is_transposed=True), _window_linear(x, w, offs, None))
    result = {"command": "python bench/grouped_launch.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "direct": _kernel_direct(device), "bit_identical": same,
              "shape": {"experts": n, "rows": args.rows, "in": hidden, "out": 2 * inter}, "calls": args.calls}
    for name, fn in (("transformers_us", lambda: _grouped_linear(x, w, offs, is_transposed=True)),
                     ("window_linear_us", lambda: _window_linear(x, w, offs, None)),
                     ("grouped_mm_op_us", lambda: torch._grouped_mm(x, w, offs=offs))):
        rounds = host_us(fn, args.calls, device)
        result[name] = {"median": statistics.median(rounds), "rounds": rounds}
    write_result(args.out, result)
    print(json.dumps({k: (v["median"] if isinstance(v, dict) and "median" in v else v) for k, v in result.items() if k != "command"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
