"""What a whole-layer call's padded windows cost on the device: grouped GEMMs over a buffer of
``T * min(k, slots)`` rows of which the offsets cover only the routed ones, against the same
GEMMs over exactly those rows, plus the gather and scatter around them.

    python bench/padded_gemm.py [--tokens 2048] [--top-k 8] [--experts 128] [--slots 8] [--hidden 2048] [--inter 768] --out FILE

Uniform routing of ``tokens`` tokens over ``experts`` experts gives a window of ``slots`` experts
about ``tokens * top_k * slots / experts`` rows; the buffer holds ``tokens * min(top_k, slots)``.
Device times are CUDA-event medians over 50 launches each, after a warm-up.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from tiers.tools.measure import event_seconds, write_result  # noqa: E402


def device_ms(fn, reps: int = 50) -> float:
    return event_seconds(fn, reps) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T, k, S, H, inter = args.tokens, args.top_k, args.slots, args.hidden, args.inter
    cap = T * min(k, S)
    rows = T * k * S // args.experts
    counts = torch.full((S,), rows // S, dtype=torch.int32, device=dev)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    up = torch.randn(S, H, 2 * inter, device=dev, dtype=torch.bfloat16, generator=g)
    down = torch.randn(S, inter, H, device=dev, dtype=torch.bfloat16, generator=g)
    hidden = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    tok = torch.randint(0, T, (cap,), device=dev, generator=g)
    dest = torch.randint(0, T * k, (cap,), device=dev, generator=g)
    w = torch.rand(cap, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.zeros(T * k + 1, H, device=dev, dtype=torch.bfloat16)

    def mlp(x):
        h = torch._grouped_mm(x, up, offs=offs)
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        return torch._grouped_mm(h, down, offs=offs)

    exact_x, padded_x = hidden[tok[:rows]], hidden[tok]
    result = {"command": "python bench/padded_gemm.py " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(dev),
              "tokens": T, "top_k": k, "slots": S, "rows": rows, "buffer_rows": cap,
              "routed_rows_equal": torch.equal(mlp(padded_x)[:rows], mlp(exact_x)),
              "gemms_exact_ms": device_ms(lambda: mlp(exact_x)),
              "gemms_padded_ms": device_ms(lambda: mlp(padded_x)),
              "window_exact_ms": device_ms(lambda: out.index_copy_(0, dest[:rows], mlp(hidden[tok[:rows]]) * w[:rows].unsqueeze(-1))),
              "window_padded_ms": device_ms(lambda: out.index_copy_(0, dest, mlp(hidden[tok]) * w.unsqueeze(-1)))}
    print(json.dumps(result, indent=1))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
