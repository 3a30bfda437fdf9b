"""The Triton kernel behind ``quant.int8``'s dequantization on CUDA (imported only where Triton is present).

Grid: (blocks, stack): program (b, j) decodes block ``b`` of stack element ``j``, whose codes,
scales and output lie at ``j`` times their stack strides from the first element's. Each element
is ``[rows, cols]`` with contiguous rows; its scales are one fp32 per row. The arithmetic is
``quant.int8``'s: the code in fp32 times the row's scale, rounded once to the output dtype, so
the kernel and ``torch.mul`` agree bit for bit (the tests compare them).

Why: ``torch.mul(codes, scale, out=out)`` mixes three dtypes and broadcasts the scale, which
torch runs through its generic elementwise kernel. On the H200, under torch.profiler in a
Qwen3-30B-A3B prefill (``tiers_50_int8@skewed``), a stack of 15 experts' gate-and-up codes took
about 0.2 ms: some 0.7 TB/s of reads and writes against the HBM's 4.8. A whole-layer call's last
part waits for its dequantization, so that time is part of the call's tail.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import triton_relauncher

BLOCK = 4096  # elements per program
WARPS = 4


@triton.jit
def _dequant(q, q_stride, s, s_stride, out, out_stride, n, cols, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)
    i = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    codes = tl.load(q + j * q_stride + i, mask=m, other=0)
    scale = tl.load(s + j * s_stride + i // cols, mask=m, other=0.0)
    value = (codes.to(tl.float32) * scale).to(out.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out + j * out_stride + i, value, mask=m)


_RELAUNCH = triton_relauncher(_dequant, dict(BLOCK=BLOCK, num_warps=WARPS))


def launch(q: torch.Tensor, q_stride: int, s: torch.Tensor, s_stride: int, out: torch.Tensor, out_stride: int,
           stack: int, n: int, cols: int) -> None:
    """Decode ``stack`` elements of ``n`` codes each (``cols`` per row) into ``out``."""
    args = (q, q_stride, s, s_stride, out, out_stride, n, cols)
    # what decides Triton's compiled kernel: the dtypes, the pointers' 16-byte alignment and the
    # integers (keyed by value: a specialization is never reused for other values)
    key = (q.dtype, s.dtype, out.dtype, q.data_ptr() & 15 == 0, s.data_ptr() & 15 == 0, out.data_ptr() & 15 == 0,
           q_stride, s_stride, out_stride, n, cols)
    _RELAUNCH((triton.cdiv(n, BLOCK), stack), args, key)
