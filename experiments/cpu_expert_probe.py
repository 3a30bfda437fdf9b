"""How fast the host computes one token through an expert, against how fast the expert crosses PCIe.

    python experiments/cpu_expert_probe.py [--shapes mixtral,qwen3_moe] [--threads 4,8,15,16] [--experts 8]
                                     [--reps 10] --out FILE

For each expert shape (hidden H, intermediate I, gate and up fused as transformers keeps them),
``--experts`` distinct random experts (so that no two timed calls read the same bytes from the
caches) are computed for one token on the CPU, in turn:

- ``bf16``: ``x @ gate_up.T``, SiLU gate, ``@ down.T``, weights in bf16;
- ``int8``: the same with per-row INT8 weights through ``torch._weight_int8pack_mm`` (codes and a
  bf16 scale per output row, the product formed inside the kernel).

Each at several intra-op thread counts, from a worker thread (where a tier would run it). Reports
ms per expert and the rate at which the weights were read (GB/s), beside the bytes bound of
moving the same expert over PCIe (its bytes / 55 GB/s). On CUDA it also times the two together:
host-to-device copies of pinned buffers on one thread while the CPU computes on another, both
rates against each alone (they share the host's memory).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import torch  # noqa: E402

SHAPES = {"mixtral": (4096, 14336), "qwen3_moe": (2048, 768)}
PCIE = 55e9


def make_experts(h: int, i: int, n: int, precision: str) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        gu = torch.randn(2 * i, h, generator=g, dtype=torch.float32) * 0.02
        dn = torch.randn(h, i, generator=g, dtype=torch.float32) * 0.02
        if precision == "bf16":
            out.append({"gate_up": gu.to(torch.bfloat16), "down": dn.to(torch.bfloat16)})
        else:
            e = {}
            for name, w in (("gate_up", gu), ("down", dn)):
                s = w.abs().amax(dim=-1) / 127.0
                e[name] = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8)
                e[name + "_scale"] = s.to(torch.bfloat16)
            out.append(e)
    return out


def expert_bytes(e: dict) -> int:
    return sum(t.numel() * t.element_size() for t in e.values())


def forward(x: torch.Tensor, e: dict, i: int) -> torch.Tensor:
    if "gate_up_scale" in e:
        gu = torch._weight_int8pack_mm(x, e["gate_up"], e["gate_up_scale"])
    else:
        gu = x @ e["gate_up"].t()
    h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
    if "down_scale" in e:
        return torch._weight_int8pack_mm(h, e["down"], e["down_scale"])
    return h @ e["down"].t()


def time_cpu(experts: list[dict], h: int, i: int, threads: int, reps: int) -> list[float]:
    """ms per expert, one expert per call, from a worker thread with ``threads`` intra-op threads."""
    x = torch.randn(1, h, dtype=torch.bfloat16)

    def run() -> list[float]:
        torch.set_num_threads(threads)
        for e in experts:  # warm-up
            forward(x, e, i)
        times = []
        for r in range(reps):
            for e in experts:
                t0 = time.perf_counter()
                forward(x, e, i)
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def time_h2d(src: list[torch.Tensor], dst: torch.Tensor, seconds: float, stop: threading.Event | None = None) -> float:
    """GB/s of back-to-back host-to-device copies of ``src`` buffers into ``dst`` for ``seconds``."""
    stream = torch.cuda.Stream()
    n, t0 = 0, time.perf_counter()
    with torch.cuda.stream(stream):
        while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
            for s in src:
                dst[: s.numel()].copy_(s, non_blocking=True)
                n += s.numel()
            stream.synchronize()
    return n / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mixtral,qwen3_moe")
    ap.add_argument("--threads", default="4,8,15,16")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    cuda = torch.cuda.is_available()
    result = {"command": "python experiments/cpu_expert_probe.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
              "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu", "shapes": {}}
    for shape in a.shapes.split(","):
        h, i = SHAPES[shape]
        entry = result["shapes"][shape] = {"hidden": h, "intermediate": i}
        for precision in ("bf16", "int8"):
            experts = make_experts(h, i, a.experts, precision)
            nbytes = expert_bytes(experts[0])
            row = entry[precision] = {"expert_bytes": nbytes, "pcie_bound_ms": nbytes / PCIE * 1e3, "cpu": {}}
            for t in threads:
                ms = time_cpu(experts, h, i, t, a.reps)
                med = statistics.median(ms)
                row["cpu"][t] = {"ms_median": med, "ms_min": min(ms), "gb_s": nbytes / med / 1e6}
                print(shape, precision, t, f"{med:.3f} ms ({nbytes / med / 1e6:.1f} GB/s; PCIe bound {row['pcie_bound_ms']:.2f} ms)", flush=True)
            if cuda:
                best = max(row["cpu"], key=lambda t: row["cpu"][t]["gb_s"])
                src = [torch.empty(256 << 20, dtype=torch.uint8).pin_memory() for _ in range(2)]
                dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                alone = time_h2d(src, dst, 1.0)
                stop = threading.Event()
                rate: list[float] = []
                th = threading.Thread(target=lambda: rate.append(time_h2d(src, dst, 30.0, stop)))
                th.start()
                time.sleep(0.1)
                ms = time_cpu(experts, h, i, best, a.reps)
                stop.set()
                th.join()
                med = statistics.median(ms)
                row["together"] = {"threads": best, "h2d_gb_s_alone": alone, "h2d_gb_s_during_cpu": rate[0],
                                   "cpu_ms_median_during_h2d": med, "cpu_gb_s_during_h2d": nbytes / med / 1e6}
                print(shape, precision, "together", json.dumps(row["together"]), flush=True)
                del src, dst
            del experts
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
