"""Host compute: a decode token's warm misses computed on the host's cores, beside the copy engine.

Owns: the split of one call's warm misses between the copy engine and the host (``split``), the
worker thread and its intra-op threads, the running estimate of the host's rate, the pinned
buffers a token's hidden state and routing weights come down in and its partial output goes up
in, and an expert's forward from its warm blob on the host (bf16 GEMVs, or INT8 codes through
``torch._weight_int8pack_mm``, which applies each output row's scale inside the kernel).

Why: at batch 1 an expert's forward reads each weight once, so the host's memory can compute it
about as fast as PCIe can move it. On the H200 machine's 16 cores a Mixtral-8x7B expert took
6.2 ms in bf16 and 2.3 ms in INT8 (PCIe: 6.4 and 3.2 ms), 7.6 and 3.6 ms while the copy engine ran
beside it, which itself slowed from 55 to 53 GB/s (``bench/results/cpu_expert_probe.json``). A
call whose misses are split between the two finishes in about the time of the larger share.

Numerics: not bit-identical to the GPU path (another GEMV, INT8 scales rounded to bf16 for the
kernel); the per-pick outputs are weighted and summed in fp32, then added to the GPU picks' sum.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

# The copy engine's rate for a miss's copy beside host compute (bench/results/cpu_expert_probe.json:
# 52.9-53.8 GB/s while the host computed, 54.7-55.0 alone).
COPY_BYTES_PER_S = 53e9
RATE_SMOOTHING = 0.25  # weight of each finished task's rate in the running estimate
# A call with warm misses gives the host none of them while the estimate says it is slower; after
# this many such calls in a row the next takes one anyway, so a slow task (a cold start, a busy
# host) cannot keep the estimate low for good. On the H200, before this, every bf16 arm's estimate
# stayed at the 25.6 GB/s of its first tasks, and the host computed nothing afterwards.
EXPLORE_CALLS = 32


def split(sizes: list[int], copy_busy: float, host_rate: float, copy_rate: float = COPY_BYTES_PER_S) -> list[bool]:
    """For each of a call's warm misses (``sizes``: their bytes in warm form), whether the host
    computes it. Largest first, each goes where it would be done sooner: the copy engine, already
    busy ``copy_busy`` seconds with the call's other misses, or the host. A tie goes to the copy
    engine, whose copy also leaves the expert cached on the GPU."""
    host_t, copy_t = 0.0, copy_busy
    out = [False] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        h, c = host_t + sizes[i] / host_rate, copy_t + sizes[i] / copy_rate
        if h < c:
            out[i], host_t = True, h
        else:
            copy_t = c
    return out


def expert_forward(module: torch.nn.Module, x: torch.Tensor, views: dict[str, Any]) -> torch.Tensor:
    """One expert's output for the rows ``x`` ([n, H], on the host), from its warm blob's
    ``views`` (each tensor's prepared fields), as the experts module computes it: the up (or fused
    gate and up) projection, the module's gate or activation, the down projection."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    h = _linear(x, views[up])
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    return _linear(h, views["down_proj"])


def _linear(x: torch.Tensor, q: Any) -> torch.Tensor:
    """``x @ W.T`` for a weight kept [out, in] as bf16 (``data``) or per-row INT8 (``qdata``, ``scale``)."""
    if "qdata" in q.data:
        codes, scale = q.data["qdata"], q.data["scale"].reshape(-1)
        if int8_kernel_ok(codes.shape[0], codes.shape[1], x.dtype):
            return torch._weight_int8pack_mm(x, codes, scale.to(x.dtype))
        w = torch.mul(codes, scale.unsqueeze(-1), out=torch.empty(codes.shape, dtype=x.dtype))  # as quant.int8 dequantizes
        return x @ w.t()
    w = q.data["data"]
    return x @ (w if w.dtype == x.dtype else w.to(x.dtype)).t()


_INT8_KERNEL_OK: dict[tuple[int, int, torch.dtype], bool] = {}


def int8_kernel_ok(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether ``torch._weight_int8pack_mm`` computes a [1, k] x [n, k] product right here: checked
    once per shape against a float64 reference on random codes. The kernel is taken only for
    inner sizes that are a multiple of 16: in torch 2.13's CPU build it returned NaN or inf for
    inner sizes 8, 24, 40, 56 and 72 and crashed the process for 3 (any output size worked)."""
    key = (n, k, dtype)
    ok = _INT8_KERNEL_OK.get(key)
    if ok is None:
        ok = False
        if k % 16 == 0 and k > 0:
            g = torch.Generator().manual_seed(0)
            rows = n if n * k <= 1 << 22 else 64 + n % 64  # the output tail as the real shape has it
            codes = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
            scale = torch.rand(rows, generator=g).to(dtype) + 0.5
            x = torch.randn(1, k, generator=g).to(dtype)
            got = torch._weight_int8pack_mm(x, codes, scale).double()
            want = x.double() @ (codes.double() * scale.double().unsqueeze(-1)).t()
            ok = bool(torch.isfinite(got).all()) and (got - want).norm().item() <= 1e-2 * want.norm().item()
        _INT8_KERNEL_OK[key] = ok
    return ok


def supported(module: torch.nn.Module) -> str | None:
    """Why the host cannot compute ``module``'s experts (None: it can)."""
    if getattr(module, "is_transposed", False):
        return "its expert weights are stored transposed ([in, out]), and per-row INT8 scales then lie along the inputs"
    if getattr(module, "has_bias", False):
        return "its experts have biases"
    if getattr(module, "has_post_expert_norm", False):
        return "its experts end with a norm"
    return None


def _start_worker(threads: int) -> None:
    """The worker's intra-op threads, started before its first task."""
    torch.set_num_threads(threads)
    a = torch.ones(64, 64)
    torch.mm(a, a)


def default_threads(device: torch.device) -> int:
    """Intra-op threads for host compute when the config leaves it to us: beside a GPU every core
    but one (the serving thread keeps one to queue the GPU's work while the host computes), else
    torch's own count."""
    if device.type != "cuda":
        return torch.get_num_threads()
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1))


class HostCompute:
    """The worker that computes decode misses on the host, and the buffers around it.

    ``stage`` queues the token's hidden state and routing weights down into pinned buffers, ahead
    of the routing sync that then brings them along; ``submit`` hands the host's picks to the worker
    (one thread; the GEMVs run on its intra-op threads and release the GIL); ``finish`` waits for
    them and adds their sum, uploaded from a ring of pinned rows, to the GPU picks' output."""

    RING = 8  # pinned output rows; a row is rewritten only after its upload has run

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, top_k: int, threads: int = 0):
        threads = threads or default_threads(device)
        self.device = device
        self.threads = threads
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="tiers-host-compute", initializer=_start_worker, initargs=(threads,))
        self.rate = COPY_BYTES_PER_S  # until measured: as fast as a copy, so a call's second miss tries the host
        self.measured = 0  # tasks timed; the first (the worker's intra-op threads still waking) is not counted in the rate
        self.passed = 0  # calls in a row whose warm misses all went to the copy engine
        self.explored = 0
        pin = device.type == "cuda"
        self.x = torch.empty(1, hidden, dtype=dtype, pin_memory=pin)
        self.w = torch.empty(1, top_k, dtype=torch.float32, pin_memory=pin)
        self.out = torch.empty(self.RING, 1, hidden, dtype=dtype, pin_memory=pin)
        self.uploaded: list[Any | None] = [None] * self.RING
        self.next = 0
        self.experts = self.bytes = 0
        self.seconds = 0.0

    def decide(self, sizes: list[int], copy_busy: float) -> list[bool]:
        """``split`` at the host's estimated rate; after ``EXPLORE_CALLS`` calls in a row that gave
        the host nothing, the smallest miss goes to the host anyway, to measure it again."""
        chosen = split(sizes, copy_busy, self.rate)
        if any(chosen) or not sizes:
            self.passed = 0 if sizes else self.passed
            return chosen
        self.passed += 1
        if self.passed >= EXPLORE_CALLS:
            self.passed = 0
            self.explored += 1
            chosen[min(range(len(sizes)), key=sizes.__getitem__)] = True
        return chosen

    def stage(self, hidden_states: torch.Tensor, weights: torch.Tensor) -> None:
        """Queue one token's hidden state ([1, H]) and routing weights ([1, k]) down to the host,
        on the current stream; they are there once the call's routing sync returns."""
        self.x.copy_(hidden_states, non_blocking=True)
        self.w[:, : weights.shape[-1]].copy_(weights, non_blocking=True)

    def submit(self, module: torch.nn.Module, picks: list[tuple[int, dict, int]]) -> Future:
        """Compute ``picks`` on the worker: (position among the token's picks, the expert's warm
        views, its bytes). The result is their outputs weighted and summed in fp32, [1, H]."""
        return self.worker.submit(self._run, module, picks)

    def _run(self, module: torch.nn.Module, picks: list[tuple[int, dict, int]]) -> torch.Tensor:
        t0 = time.perf_counter()
        with torch.no_grad():
            acc = torch.zeros(1, self.x.shape[1], dtype=torch.float32)
            for pos, views, _ in picks:
                acc.add_(expert_forward(module, self.x, views).float(), alpha=float(self.w[0, pos]))
        seconds = time.perf_counter() - t0
        nbytes = sum(n for _, _, n in picks)
        if self.measured:
            self.rate += RATE_SMOOTHING * (nbytes / max(seconds, 1e-9) - self.rate)
        self.measured += 1
        self.experts += len(picks)
        self.bytes += nbytes
        self.seconds += seconds
        return acc

    def finish(self, future: Future, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the GPU picks' sum, [1, H]) plus the host picks' sum, once the worker has it."""
        acc = future.result()
        if self.device.type != "cuda":
            return out + acc.to(out.dtype)
        i, self.next = self.next, (self.next + 1) % self.RING
        if self.uploaded[i] is not None:
            self.uploaded[i].synchronize()  # its last upload has run long since (RING calls ago)
        self.out[i].copy_(acc)
        up = self.out[i].to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.uploaded[i] = ev
        return out + up.to(out.dtype)

    def report(self) -> dict[str, float]:
        return {"on": 1, "threads": self.threads, "experts": self.experts, "bytes": self.bytes, "seconds": self.seconds,
                "rate_gbps": self.rate / 1e9, "explored": self.explored}

    def reset(self) -> None:
        self.experts = self.bytes = self.explored = 0
        self.seconds = 0.0

    def close(self) -> None:
        self.worker.shutdown(wait=True)
