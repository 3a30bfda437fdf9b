"""INT8 dequantization's memory rate on the GPU: the Triton kernel against torch.mul and a plain copy.

    python experiments/dequant_rate.py [--reps 50] [--out FILE]

For each expert tensor of Qwen3-30B-A3B and Mixtral-8x7B (gate and up fused, and down), stacked
as the engine stacks a streamed part's experts (codes and scales strided across the stack, a
blob per transit row), times ``quant.int8``'s dequantization into a slab through the Triton
kernel (at every size: ``quant.int8.KERNEL_MIN_CODES`` set to 0) and through ``torch.mul`` (the
path off CUDA, and for small dequantizations), and a bf16 device-to-device copy of the
output's size as the rate the memory gives in the same run. Each rate counts the bytes a pass
must move: codes and scales read, output written (the copy: output read and written). The bound
for a dequantization is its bytes at the copy's rate. Times are medians over ``--reps`` launches
(``tools.measure.event_seconds``: CUDA events around each, so a launch that costs the host more
than the device shows its host time); ``*_host_us`` is the host time per call, queued back to
back. Needs CUDA (and Triton for the kernel). The committed results were timed with three
warm-up launches, where ``event_seconds`` now takes one.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

STACKS = {"qwen3_moe": (1, 8, 15), "mixtral": (1, 2)}


def tensors(model: str) -> dict[str, tuple[int, int]]:
    from tiers.tools.measure import SHAPES

    s = SHAPES[model]
    h = s["hidden_size"]
    i = s.get("moe_intermediate_size", s["intermediate_size"])
    return {"gate_up": (2 * i, h), "down": (h, i)}


def stacked(k: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k experts' codes ``[k, rows, cols]`` and scales ``[k, rows, 1]`` in rows of one byte buffer."""
    at = (rows * cols + 15) // 16 * 16
    width = at + (4 * rows + 15) // 16 * 16
    buf = torch.empty((k, width), dtype=torch.uint8, device="cuda")
    q = buf[:, : rows * cols].view(torch.int8).view(k, rows, cols)
    q.copy_(torch.randint(-127, 128, (k, rows, cols), dtype=torch.int8, device="cuda"))
    s = buf[:, at : at + 4 * rows].view(torch.float32).view(k, rows, 1)
    s.copy_(torch.rand((k, rows, 1), device="cuda") * 0.05 + 1e-3)
    return q, s


def host_us(fn, reps: int) -> float:
    """Host microseconds per call of ``fn``, queued back to back (the device catches up after)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dequant_rate needs a CUDA device")

    from tiers import quant
    from tiers.quant import QuantizedTensor
    from tiers.quant import int8 as int8_mod
    from tiers.tools.measure import event_seconds, write_result

    scheme = quant.get_scheme("int8")
    int8_mod.KERNEL_MIN_CODES = 0  # time the kernel at every size (the library leaves small ones to torch.mul)
    rows_out = []
    for model, ks in STACKS.items():
        for name, (r, c) in tensors(model).items():
            for k in ks:
                q, s = stacked(k, r, c)
                out = torch.empty((k, r, c), dtype=torch.bfloat16, device="cuda")
                other = torch.empty_like(out)
                qt = QuantizedTensor("int8", (k, r, c), {"qdata": q, "scale": s})
                n = k * r * c
                moved = n + 4 * k * r + 2 * n  # codes and scales read, bf16 written
                t_copy = event_seconds(lambda: other.copy_(out), args.reps)
                t_mul = event_seconds(lambda: torch.mul(q, s, out=out), args.reps)
                row = {"model": model, "tensor": name, "shape": [k, r, c], "bytes": moved,
                       "copy_gbps": 4 * n / t_copy / 1e9, "bound_ms": moved / (4 * n / t_copy) * 1e3,
                       "torch_mul_ms": t_mul * 1e3, "torch_mul_gbps": moved / t_mul / 1e9,
                       "torch_mul_host_us": host_us(lambda: torch.mul(q, s, out=out), args.reps)}
                if int8_mod.kernel_available():
                    t_kernel = event_seconds(lambda: scheme.dequantize(qt, out=out), args.reps)
                    expected = torch.mul(q, s, out=torch.empty_like(out))
                    scheme.dequantize(qt, out=out)
                    row.update(kernel_ms=t_kernel * 1e3, kernel_gbps=moved / t_kernel / 1e9,
                               kernel_host_us=host_us(lambda: scheme.dequantize(qt, out=out), args.reps),
                               kernel_over_bound=t_kernel * 1e3 / row["bound_ms"], exact=bool(torch.equal(out, expected)))
                rows_out.append(row)
                print({k_: round(v, 3) if isinstance(v, float) else v for k_, v in row.items()}, flush=True)
    write_result(args.out, {"command": "python experiments/dequant_rate.py " + " ".join(sys.argv[1:]),
                            "device": torch.cuda.get_device_name(), "triton": int8_mod.kernel_available(), "rows": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
