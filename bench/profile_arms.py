"""Where a decode token's and a prefill's time goes: torch.profiler over the all-GPU model and Tiers arms.

    python bench/profile_arms.py [--model mixtral] [--layers 4] [--arms all_gpu,tiers_100_bf16,tiers_25_int8]
                            [--tokens 4] [--prefill 2048] [--out DIR] [--trace ARM]

A Tiers arm is ``tiers_<gpu %>_<precision>``, optionally followed by ``+ahead<N>`` (prefetch depth N)
and ``@skewed`` (routed by the skewed trace of ``tools/bench.py``, rebalancing every 8 tokens) or
``@skewed_norebal`` (the same routing, rebalancer off).

Builds a random-weight model of real shapes (``tools.measure``), packs it, and for each arm times
decode (median of three (generate 1 + T) - (generate 1) differences) and then profiles one
generate of ``--tokens`` tokens and one prefill. The engine's host-side steps are wrapped in
``record_function`` ranges for the run (routing sync, acquiring a layer, staging, slot maps, the
grouped kernels), so the tables show host time per step next to the device kernels.

Writes, per arm, ``profile-<model>-<arm>.txt`` (tables sorted by host and by device time, plus a
summary: wall time, device busy time per stream kind, blocking host calls), and a JSON summary of
all arms. ``--trace ARM`` also writes that arm's decode and prefill chrome traces (gzipped).
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
            "cudaHostAlloc", "cudaHostRegister", "cudaMalloc", "cudaFree", "cudaLaunchKernel", "cudaStreamWaitEvent", "cudaEventRecord")


def wrap_engine() -> None:
    """Name the engine's host steps in the profile (only in this script's process)."""
    from tiers import engine, integration, rebalance

    def named(owner, attr, label):
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        setattr(owner, attr, inner)

    for attr in ("acquire_layer", "_stage", "_dequantize", "_close", "_fetch", "slot_map", "wait_all", "release_all", "begin_call", "pump",
                 "count_static", "_stage_direct", "_stage_copy", "_stage_copy_run", "fetch_stack", "take_direct_usage", "prefetch",
                 "begin_stream", "stream_part", "wait_part", "end_part", "end_stream", "stage_ahead", "direct_ready", "fetch_direct",
                 "begin_decode", "end_decode", "_refresh_direct", "_build_direct"):
        named(engine.TierManager, attr, f"tiers.{attr}")
    for attr in ("note_call", "land", "rebalance", "_issue", "_finish_hot", "_finish_warm"):
        named(rebalance.Rebalancer, attr, f"tiers.rebalance.{attr}")
    for attr in ("_route", "_grouped_in_parts", "_grouped_streamed", "_sorted_by_slot", "_run_windows", "_chunks"):
        named(integration, attr, f"tiers.{attr}")
    named(integration, "grouped_mm_experts_forward", "tiers.grouped_mm")


def safe(name: str) -> str:
    """An arm's name as a file name of letters, digits, ``_`` and ``-`` only."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", name)


def summarize(prof, wall_s: float) -> dict:
    """Device busy time by kind (kernels, H2D copies), and host time in blocking or launch calls."""
    kernels = copies = 0.0
    host: dict[str, list] = {}
    for e in prof.events():
        dev = getattr(e, "device_type", None)
        name = e.name
        if dev is not None and str(dev).endswith("CUDA"):
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            if "Memcpy" in name or "memcpy" in name:
                copies += t
            elif "Memset" not in name:
                kernels += t
        elif name in BLOCKING:
            c = host.setdefault(name, [0, 0.0])
            c[0] += 1
            c[1] += e.cpu_time_total
    return {"wall_ms": wall_s * 1e3, "kernel_ms": kernels / 1e3, "h2d_copy_ms": copies / 1e3,
            "host_calls": {k: {"count": n, "ms": t / 1e3} for k, (n, t) in sorted(host.items())}}


def python_profile(fn, device) -> list[str]:
    """``fn`` once under cProfile: the top functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    with torch.no_grad():
        fn()
        sync(device)
        pr = cProfile.Profile()
        pr.enable()
        fn()
        sync(device)
        pr.disable()
    text = []
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(45)
        text += [f"### by {key}", buf.getvalue()]
    return text


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--arms", default="all_gpu,tiers_100_bf16,tiers_25_int8")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--out", default="profile-out")
    ap.add_argument("--trace", default="", help="comma-separated arms whose decode and prefill chrome traces are written")
    ap.add_argument("--staging-slots", default="auto", help="the Tiers arms' tiers.gpu.staging_slots")
    ap.add_argument("--workdir")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile one decode generate: Python time by function")
    args = ap.parse_args()

    import tiers
    from tiers.loader.pack import pack
    from tiers.integration import manager_of
    from tiers.tools.measure import SHAPES, TINY, build, decode_ms_per_token, expert_bytes_of, write_result

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict((TINY if args.tiny else SHAPES)[args.model], layers=args.layers)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tiers-profile-"))
    model = build(args.model, shape, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=g).to(device)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prefill), generator=g).to(device)
    arms = args.arms.split(",")
    traced = set(args.trace.split(",")) if args.trace else set()
    summary = {"command": "python bench/profile_arms.py " + " ".join(sys.argv[1:]), "model": args.model, "shape": shape,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "arms": {}}
    wrap_engine()

    def one(name, m):
        from tiers.tools.routing import TraceRouting

        if "@skewed" in name:  # as tools/bench.py routes its skewed arms
            with TraceRouting(m, tokens=max(4096, 2 * args.prefill)):
                return profiled(name, m)
        return profiled(name, m)

    def profiled(name, m):
        kw = dict(do_sample=False, pad_token_id=0)
        m.generate(prompt, max_new_tokens=16, min_new_tokens=16, **kw)  # warm-up
        row = {"decode_ms_per_token": statistics.median(decode_ms_per_token(m, prompt, 8, device, 1) for _ in range(3))}
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        text = [f"# {args.model} ({args.layers} layers), arm {name}: {row['decode_ms_per_token']:.2f} ms/token decode"]
        for phase, fn in (("decode", lambda: m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)),
                          ("prefill", lambda: m(ids))):
            with torch.no_grad():
                fn()
                sync(device)
                with profile(activities=acts) as prof:
                    t0 = time.perf_counter()
                    fn()
                    sync(device)
                    wall = time.perf_counter() - t0
            row[phase] = summarize(prof, wall)
            ka = prof.key_averages()
            text += [f"\n## {phase}: {json.dumps(row[phase])}\n", "### by host time (self)",
                     ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)]
            if device.type == "cuda":
                text += ["### by device time (self)", ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)]
            if name in traced:
                raw = work / f"trace-{name}-{phase}.json"
                prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as f, gzip.open(out / f"trace-{args.model}-{safe(name)}-{phase}.json.gz", "wb") as z:
                    shutil.copyfileobj(f, z)
        if args.cprofile:
            text += ["\n## decode under cProfile (Python functions; cProfile's own cost inflates small ones)\n"]
            text += python_profile(lambda: m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw), device)
            text += ["\n## prefill under cProfile\n"]
            text += python_profile(lambda: m(ids), device)
        (out / f"profile-{args.model}-{safe(name)}.txt").write_text("\n".join(text) + "\n")
        summary["arms"][name] = row
        print(name, json.dumps(row), flush=True)

    expert_bytes = expert_bytes_of(model)
    if "all_gpu" in arms:
        one("all_gpu", model)
    model.save_pretrained(work / "hf")
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    pack(work / "hf", work / "packed", precisions=["bf16", "int8"], overwrite=True, progress=False, device=device)
    shutil.rmtree(work / "hf", ignore_errors=True)
    for name in [a for a in arms if a.startswith("tiers_")]:
        arm = re.fullmatch(r"tiers_(\d+)_(\w+?)(?:\+ahead(\d))?(@skewed(?:_norebal)?)?", name)
        if arm is None:
            raise SystemExit(f"--arms: cannot read {name!r} (expected tiers_<pct>_<precision>[+ahead<N>][@skewed[_norebal]])")
        pct, precision, depth, skewed = arm.groups()
        slots = args.staging_slots if args.staging_slots == "auto" else int(args.staging_slots)
        cfg = {"tiers": {"gpu": {"fraction": int(pct) / 100, "staging_slots": slots, "prefetch_depth": int(depth or 0)},
                         "cpu": {"budget": expert_bytes, "precision": precision}, "nvme": {"precision": precision},
                         "rebalance": {"every_tokens": 8 if skewed == "@skewed" else 0}}}
        m = tiers.load(work / "packed", cfg, device=device, progress=False)
        one(name, m)
        st = manager_of(m).stats()
        summary["arms"][name]["tiers"] = {"hits": st.hits, "misses": st.misses, "rebalance": st.rebalance, "streamed": st.streamed}
        manager_of(m).close()
        del m
        torch.cuda.empty_cache() if device.type == "cuda" else None
    write_result(out / f"profile-{args.model}.json", summary)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
