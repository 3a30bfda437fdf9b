"""One bench run in order: build and pack the model, then every arm, then the end-of-run measurements.

The all-GPU arms come first, on the model as built; then its experts go to pageable CPU memory
for the naive lazy and accelerate arms; then each Tiers arm (``tools.bench_tiers``) beside a
fresh all-GPU model of the same weights, which measures the all-GPU arms again at the end; then
the cache policies' replays, the copy sweep and the cold reads. An arm that fails is reported
and the others still run; the result so far is written after each arm.
"""
from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tiers.loader.pack import pack
from tiers.loader.packed import read_manifest
from tiers.tools.bench_arms import ALL_GPU_ARMS, arm_list, arm_precisions, routed, tiers_config
from tiers.tools.bench_bounds import add_bounds
from tiers.tools.bench_runtime import synthetic_replays
from tiers.tools.bench_tiers import REBALANCE_WARMUP_GENERATE, Setting, run_arm
from tiers.tools.measure import (
    INTERLEAVE_SKIP, SHAPES, TINY, build, copy_sweep, decode_ms_per_token, expert_modules, lazy_experts_forward,
    prefill_seconds, sync, write_result,
)


def run(args) -> dict:
    """Every arm ``args`` asks for, and the end-of-run measurements: the result, its bounds derived."""
    b = BenchRun(args)
    model = build(args.model, b.shape, b.device)
    mods = b.prepare(model)
    for name in ALL_GPU_ARMS:
        if name in b.arms:
            with b.routed(model, name):
                b.measure(name, model, {"experts_implementation": model.config._experts_implementation})
    b.save_and_pack(model)
    cpu_experts = b.experts_to_cpu(mods)
    model = b.offloaded_arms(model, mods, cpu_experts)
    del model, mods
    b.free()
    b.tiers_arms()
    b.free()
    b.end_of_run()
    add_bounds(b.result)
    if not args.workdir:
        shutil.rmtree(b.work, ignore_errors=True)
    return b.result


class BenchRun:
    """A run's flags, device, arms, inputs and result so far, and the steps that fill it in."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        shapes = TINY if args.tiny else SHAPES
        self.shape = dict(shapes[args.model])
        if args.layers:
            self.shape["layers"] = args.layers
        self.arms = arm_list(args.arms)
        if self.device.type != "cuda" and "accelerate" in self.arms:
            self.arms.remove("accelerate")  # its CPU offload hooks need a separate execution device
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="tiers-bench-"))
        self.src, self.packed = self.work / "hf", self.work / "packed"
        self.result: dict = {"command": "python tools/bench.py " + " ".join(args.argv), "model": args.model, "shape": self.shape,
                             "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                             "torch": torch.__version__, "decode_tokens": args.tokens, "prefill_tokens": args.prefill, "arms": {}}
        self.bar = tqdm(total=len(self.arms) + 2, desc="bench", unit="step")
        self.skew = dict(zipf_s=args.zipf, reuse_p=args.reuse, seed=0)
        self.result["routing"] = {"uniform": "the random-weight routers",
                                  "skewed": {**self.skew, "model": "tools.trace.TraceModel via tools.routing.TraceRouting"}}

    def routed(self, model, name: str):
        """Route ``model`` by the skewed trace for an arm named ``...@skewed...``; a no-op context otherwise."""
        return routed(model, name, self.skew, max(4096, 2 * self.args.prefill))

    def prepare(self, model) -> dict:
        """The prompts, the model's expert counts and bytes, and the attention warm-up; its experts modules."""
        g = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        self.top_k = model.config.num_experts_per_tok
        self.prompt = torch.randint(0, vocab, (1, 16), generator=g).to(self.device)  # [1, 16]
        self.prefill_ids = torch.randint(0, vocab, (1, self.args.prefill), generator=g).to(self.device)  # [1, P]
        mods = expert_modules(model)
        self.expert_bytes = sum(p.numel() * p.element_size() for _, m in mods.values() for n, p in m.named_parameters(recurse=False)
                                if p.dim() >= 3)
        self.result["expert_bytes_bf16"] = self.expert_bytes
        self.result["experts"] = sum(m.num_experts for _, m in mods.values())
        if self.args.attention_warmup:
            self.result["attention_warmup"] = warm_attention(model, self.prompt, attention_warmup_tokens(self.args), self.device)
        return mods

    def save_partial(self) -> None:
        if self.args.out:
            write_result(Path(self.args.out) / f"bench-{self.args.model}.partial.json", self.result)

    def failed(self, name: str, e: Exception) -> None:
        self.result["arms"][name] = {"error": f"{type(e).__name__}: {e}"}
        self.bar.update(1)
        self.save_partial()

    def done(self, name: str, row: dict) -> None:
        self.result["arms"][name] = row
        self.bar.set_postfix_str(f"{name}: {row['decode_ms_per_token']:.1f} ms/token")
        self.bar.update(1)
        self.save_partial()

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def measure(self, name: str, m, extra: dict | None = None, slow: bool = False) -> None:
        """An all-GPU, lazy or accelerate arm: decode ms/token, prefill time, peak GPU memory."""
        args, device = self.args, self.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tokens, r = (args.slow_tokens, 1) if slow else (args.tokens, args.reps)
        if not slow:  # the same warm-up as the Tiers arms get (the first arm also pays one-time CUDA set-up)
            m.generate(self.prompt, max_new_tokens=args.warmup_tokens, min_new_tokens=args.warmup_tokens, do_sample=False, pad_token_id=0)
        row = {"decode_ms_per_token": decode_ms_per_token(m, self.prompt, tokens, device, r), "decode_tokens": tokens}
        row["decode_tok_s"] = 1e3 / row["decode_ms_per_token"]
        row["prefill_s"] = prefill_seconds(m, self.prefill_ids, device, 1 if slow else max(1, args.reps - 1))
        if device.type == "cuda":
            row["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row.update(extra or {})
        self.done(name, row)

    def save_and_pack(self, model) -> None:
        """``save_pretrained`` (to ``--hf-dir`` if given) and pack in bf16, INT8 and the arms' other precisions, both timed."""
        t0 = time.perf_counter()
        if self.args.hf_dir:
            self.src = Path(self.args.hf_dir)
        model.save_pretrained(self.src)
        self.result["save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        pack(self.src, self.packed, precisions=arm_precisions(self.arms), overwrite=True, progress=False, device=self.device)
        self.result["pack_s"] = time.perf_counter() - t0
        shutil.rmtree(self.src, ignore_errors=True)
        self.bar.update(1)

    def experts_to_cpu(self, mods: dict) -> dict[str, dict[str, torch.Tensor]]:
        """Experts to pageable CPU memory, shared by the lazy and accelerate arms (on meta in the model)."""
        cpu_experts = {}
        for layer, (name, m) in mods.items():
            cpu_experts[name] = {n: p.detach().to("cpu") for n, p in m.named_parameters(recurse=False) if p.dim() >= 3}
            for n, p in list(m.named_parameters(recurse=False)):
                if p.dim() >= 3:
                    m._parameters[n] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
        self.free()
        return cpu_experts

    def offloaded_arms(self, model, mods: dict, cpu_experts: dict):
        """The naive lazy arm (each hit expert moved with ``.to()``) and accelerate's
        ``dispatch_model`` with the experts on "cpu"; the model as the last of them left it."""
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if "lazy" in self.arms:
            if "tiers_lazy_to" not in ALL_EXPERTS_FUNCTIONS:
                ALL_EXPERTS_FUNCTIONS.register("tiers_lazy_to", lazy_experts_forward)
            for name, m in mods.values():
                m._lazy = cpu_experts[name]
            model.set_experts_implementation("tiers_lazy_to")
            try:
                self.measure("lazy", model, slow=True)
            except Exception as e:  # an arm that fails is reported, the others still run
                self.failed("lazy", e)
        if "accelerate" in self.arms:
            for name, m in mods.values():
                for n, t in cpu_experts[name].items():
                    m._parameters[n] = torch.nn.Parameter(t, requires_grad=False)
            default_impl = self.result["arms"].get("all_gpu", {}).get("experts_implementation", "grouped_mm")
            model.set_experts_implementation(default_impl)
            device_map = {"": self.device.index or 0} | {name: "cpu" for name, _ in mods.values()}
            try:
                from accelerate import dispatch_model  # the baseline only: pip install -e ".[bench]"

                model = dispatch_model(model, device_map=device_map, main_device=self.device.index or 0)
                self.measure("accelerate", model, slow=True)
            except Exception as e:
                self.failed("accelerate", e)
        return model

    def tiers_arms(self) -> None:
        """Each Tiers arm, then the all-GPU arms again, on a fresh all-GPU model of the same weights.

        That model stays beside the Tiers arms: each one is paired with an all-GPU measurement of
        the same routing, its repetitions interleaved with the arm's (a host whose speed drifts
        within seconds moves both). The all-GPU arms are measured on it again at the end: the
        first measurement also meets a cold machine, and each Tiers arm's bound is held against
        the faster of the two."""
        tiers_arms = [a for a in self.arms if a.startswith("tiers_")]
        again = [name for name in ALL_GPU_ARMS if name in self.arms]
        paired = build(self.args.model, self.shape, self.device) if tiers_arms or again else None
        setting = Setting(self.args, self.device, self.packed, self.prompt, self.prefill_ids, paired, self.arms, self.skew, {})
        for name in tiers_arms:
            cfg = tiers_config(name, self.args, self.expert_bytes, self.packed, self.top_k)
            try:
                row = run_arm(setting, cfg, name)
            except Exception as e:
                self.failed(name, e)
                continue
            row["config"] = cfg
            self.done(name, row)
            self.free()
        for name in again:
            with self.routed(paired, name):
                self.measure(name + "/end", paired, {"experts_implementation": paired.config._experts_implementation})

    def end_of_run(self) -> None:
        """Skewed, sticky routing: what the cache policy gets against Belady on the same trace; and
        the copy sweep and the cold reads where asked."""
        args = self.args
        manifest = read_manifest(self.packed)
        self.result["cache_replay"] = synthetic_replays(manifest, self.top_k, args.zipf, args.reuse)
        if self.device.type == "cuda" and args.copy_sweep:
            blob = next(iter(manifest.layers.values())).blobs["int8"].stride
            self.result["copy_sweep"] = copy_sweep(self.device, [1 << 20, blob, 16 << 20, 64 << 20, 256 << 20])
        if args.cold_read_gb:
            from tiers.tools import coldread

            try:
                self.result["cold_read"] = coldread.measure(self.packed, "int8", threads=args.reader_threads,
                                                            limit_bytes=int(args.cold_read_gb * 1e9), rounds=args.cold_read_rounds)
                self.result["cold_read"]["packed_dir"] = "(the bench's temporary pack)"  # a temporary path says nothing
            except Exception as e:  # reported, the rest of the results still land
                self.result["cold_read"] = {"error": f"{type(e).__name__}: {e}"}
        self.bar.update(1)
        self.bar.close()


def attention_warmup_tokens(args) -> int:
    """New tokens of the generate that warms attention before any arm: enough for a decode step
    at every KV length the run decodes at (its warm-up, timed and rebalancer warm-up generates,
    the lazy and accelerate arms', and the interleaved steps, untimed ones included)."""
    return max(args.warmup_tokens, args.tokens + 1, args.slow_tokens + 1, REBALANCE_WARMUP_GENERATE if args.rebalance_warmup > 0 else 0,
               args.interleave + INTERLEAVE_SKIP + 1 if args.interleave else 0)


def warm_attention(model, prompt, tokens: int, device) -> dict:
    """Generate ``tokens`` twice with the all-GPU model before any arm runs, and time both.

    Why: torch's attention builds a cuDNN plan the first time it meets a shape, where cuDNN is
    among its backends (torch 2.11 on the H200), and decode meets a new KV length at each step:
    on the H200's host each new length took about 5 ms per attention layer, tens of ms per
    step, once per process (``experiments/results/step_probe-*.json``). Unwarmed, whichever arm first
    decoded at a length paid for it: the Tiers 100% arm, the first after the all-GPU arm to
    decode past its lengths, in the interleaved steps beyond them. The plans are kept per
    shape, so one model's generate warms every arm's attention."""
    times = []
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        sync(device)
        times.append(time.perf_counter() - t0)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled() if device.type == "cuda" else None
    return {"tokens": tokens, "first_s": times[0], "second_s": times[1], "cudnn_sdp": cudnn}
