"""What the bench measures with: random-weight models of real shapes, timing, the naive lazy
``.to()`` baseline and the H2D copy sweep.

Owns: the model shapes (``SHAPES``, and ``TINY`` for smoke runs), ``build``, the timing helpers
(median of repetitions after a warm-up, with a device sync around each; ``Steps``, host time in
named callables), the lazy experts forward
registered as a baseline, and ``copy_sweep``. Invariant: every timed region ends with a device
sync, so it measures finished work.
"""
import contextlib
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

class Steps:
    """Host time in named callables, wrapped on their owners while a measurement runs: ``ms``
    and ``calls`` per label."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str, split=None) -> None:
        """Time ``owner.attr`` under ``label``, or under ``split(args, kwargs)`` of each call."""
        fn, own = getattr(owner, attr), attr in vars(owner)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                at = label if split is None else split(a, k)
                self.ms[at] = self.ms.get(at, 0.0) + (time.perf_counter() - t0) * 1e3
                self.calls[at] = self.calls.get(at, 0) + 1
        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn, own))

    def clear(self) -> None:
        """Forget what was timed so far (the wrappers stay)."""
        self.ms.clear()
        self.calls.clear()

    def restore(self) -> None:
        for owner, attr, fn, own in reversed(self._undo):
            if own:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
        self._undo = []


SHAPES = {
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, layers=8),
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                      num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[], layers=12),
}
TINY = {
    "mixtral": dict(hidden_size=128, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, layers=6),
    "qwen3_moe": dict(hidden_size=128, moe_intermediate_size=64, intermediate_size=256, num_experts=16,
                      num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      vocab_size=512, decoder_sparse_step=1, mlp_only_layers=[], layers=3),
}


def write_result(path, result: dict) -> None:
    """A bench script's result as indented JSON at ``path``, its folder made if need be."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def expert_bytes_of(model) -> int:
    """Bytes of a model's expert tensors (its 3-D parameters), as loaded."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() >= 3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_ms_per_token(model, prompt, tokens: int, device, reps: int) -> float:
    """(generate 1 + tokens) - (generate 1), per token: prefill of the prompt cancels out."""
    kw = dict(do_sample=False, pad_token_id=0)
    one = timed(lambda: model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw), device, reps)
    full = timed(lambda: model.generate(prompt, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, **kw), device, reps)
    return (full - one) / tokens * 1e3


def thread_usage() -> tuple[float, float, int, int]:
    """The calling thread's CPU seconds (user + system, its CPU clock: ``time.thread_time``),
    system seconds, minor page faults and involuntary context switches so far (the last three
    from Linux's per-thread rusage; the process's elsewhere). The CPU clock is exact to the
    nanosecond; rusage's times come in scheduler ticks on some hosts (4 ms on the H200
    machine's), so the system seconds of one short step are coarse where its CPU seconds are not."""
    import resource  # POSIX only: imported where it is used, so the module imports elsewhere

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    u = resource.getrusage(who)
    return time.thread_time(), u.ru_stime, u.ru_minflt, u.ru_nivcsw


INTERLEAVE_SKIP = 8  # interleaved_decode's untimed steps before the timed ones


def interleaved_decode(models, prompt, steps: int, device, *, skip: int = INTERLEAVE_SKIP, on_start=None,
                       usage: list[list[dict]] | None = None) -> list[list[float]]:
    """Seconds of each greedy decode step (batch 1, from ``prompt``) of each of ``models``, the
    models taking turns step by step, each step timed alone between device syncs; the order
    within a step alternates (first to last, then last to first), so neither model always
    follows the other. Each model first runs the prompt's prefill (untimed), then decodes inside
    its ``_optimize_model_for_decode`` context as generate's decode stage does, its own KV cache
    growing; ``skip`` steps run untimed before ``on_start()`` is called and the timed ``steps``.

    Why: the host's speed drifts in phases of seconds (1.5-2x), and a generate of a few dozen
    tokens per model, one after the other, can fall in different phases; step i of two models
    taking turns is a few tens of ms apart, so such a phase moves both alike.

    ``usage``: one list per model, to which each timed step appends what the serving thread did
    until the model's forward returned (before the sync): ``host_ms`` of wall time, ``cpu_ms`` and
    ``sys_ms`` of its CPU time (``thread_usage``), its minor ``faults`` and involuntary switches
    (``preempted``); a slow phase of the host shows as CPU time that grows with the wall time."""
    times: list[list[float]] = [[] for _ in models]
    # the KV cache's keyword and output field: ``cache`` in newer transformers, ``past_key_values`` before
    names = ["cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values" for m in models]
    state = []
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for m, name in zip(models, names):
            out = m(input_ids=prompt, use_cache=True)
            state.append([out.logits[:, -1:].argmax(-1), out[name]])
        for m in models:
            enter = getattr(m, "_optimize_model_for_decode", None)
            if enter is not None:
                stack.enter_context(enter())
        for step in range(skip + steps):
            if step == skip and on_start is not None:
                on_start()
            order = range(len(models)) if step % 2 == 0 else range(len(models) - 1, -1, -1)
            for i in order:
                tok, cache = state[i]
                sync(device)
                u0 = thread_usage() if usage is not None else None
                t0 = time.perf_counter()
                out = models[i](input_ids=tok, use_cache=True, **{names[i]: cache})
                host = time.perf_counter() - t0
                u1 = thread_usage() if usage is not None else None
                state[i] = [out.logits[:, -1:].argmax(-1), out[names[i]]]
                sync(device)
                if step >= skip:
                    times[i].append(time.perf_counter() - t0)
                    if usage is not None:
                        usage[i].append({"host_ms": host * 1e3, "cpu_ms": (u1[0] - u0[0]) * 1e3, "sys_ms": (u1[1] - u0[1]) * 1e3,
                                         "faults": u1[2] - u0[2], "preempted": u1[3] - u0[3]})
    return times


def block_means(values: list[float], block: int) -> list[float]:
    """The means of ``values``' consecutive whole blocks of ``block`` (a partial last block dropped)."""
    return [statistics.fmean(values[i : i + block]) for i in range(0, len(values) - block + 1, block)]


def prefill_seconds(model, ids, device, reps: int) -> float:
    with torch.no_grad():
        return timed(lambda: model(ids), device, reps)


def copy_sweep(device: torch.device, sizes: list[int], total: int = 512 << 20) -> list[dict]:
    """H2D GB/s from pinned memory: ``n`` back-to-back async copies of ``size`` bytes on one stream
    (how the engine issues one copy per expert) against one copy of the same ``n * size`` bytes."""
    rows = []
    for size in sizes:
        n = max(1, total // size)
        src = torch.empty(n * size, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(n * size, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)

        def run(chunks: int) -> float:
            step = n * size // chunks
            times = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    for i in range(chunks):
                        dst[i * step:(i + 1) * step].copy_(src[i * step:(i + 1) * step], non_blocking=True)
                    end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return n * size / statistics.median(times) / 1e9

        rows.append({"size": size, "copies": n, "separate_gbps": run(n), "one_copy_gbps": run(1)})
        del src, dst
    return rows


# -- the naive lazy arm: an experts implementation that moves each hit expert with .to() ---------

def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """One expert's projection as its eager forward computes it: ``x @ w`` for weights stored
    ``[in, out]`` (GPT-OSS), ``linear(x, w)`` for ``[out, in]``; plus the bias where there is one."""
    out = x @ w if transposed else torch.nn.functional.linear(x, w)
    return out if bias is None else out + bias


def lazy_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    final = torch.zeros_like(hidden_states)  # [T, H]
    with torch.no_grad():
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)  # [E+1, k, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        if e == self.num_experts:
            continue
        gate_up = self._lazy["gate_up_proj"][e].to(hidden_states.device)  # pageable -> GPU, synchronous
        down = self._lazy["down_proj"][e].to(hidden_states.device)
        pos, tok = torch.where(mask[e])
        h = _linear(hidden_states[tok], gate_up, self.gate_up_proj_bias[e] if self.has_bias else None, self.is_transposed)
        h = self._apply_gate(h)
        h = _linear(h, down, self.down_proj_bias[e] if self.has_bias else None, self.is_transposed) * top_k_weights[tok, pos, None]
        final.index_add_(0, tok, h.to(final.dtype))
    return final


def build(model_type: str, shape: dict, device: torch.device, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(shape)
    layers = kw.pop("layers")
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=layers, max_position_embeddings=4096, **kw)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def expert_modules(model):
    from tiers.loader.layout import find_experts_modules

    return find_experts_modules(model)
