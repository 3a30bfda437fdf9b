"""Where a long prompt's prefill time goes, without a profiler: the copy engine's busy time and gaps.

    python experiments/prefill_split.py [--model qwen3_moe] [--layers 12] [--prefill 2048] [--reps 3]
                                  [--configs int8:auto:0:0.25,int8:auto:0:0.5] --out FILE

A profiler slows the host about two-fold, which changes whether the copy engine waits on Python
or Python on the GPU, so this measures with clocks alone. Each config is precision : staging
slots : prefetch depth : GPU fraction (the rest warm), and optionally : whole (``on``: every long
call reads its whole layer without a sync, ``off``: none does; ``auto``: as the engine decides,
the default), : buffers (how many buffers a whole-layer call splits its slots into), : plan
(``copy``, the default, or ``compute``: the stream a whole-layer call uploads its plan on),
: dequant (``kernel``, the default, or ``torch``: how INT8 stacks are dequantized on CUDA,
``quant.int8.USE_KERNEL``, set before each of the config's prefills) and : route
(``uniform``, the default: the random-weight routers; ``skewed``: the bench's skewed trace,
``tools.routing.TraceRouting``; ``rebal``: the same with the rebalancer on, every
``--rebalance-every`` tokens, after ``--warm-generates`` decode generates of 33 tokens have let
it move experts; ``rebal-frozen``: as ``rebal``, then every read in flight landed and no later
interval closing, so the prefills see the moved experts and no rebalance work; skewed routes
also report the hot experts per layer and their slot runs, ``layout``); the untiered model keeps
its own routers, so a skewed config's bound takes the uniform all-GPU prefill (below the bytes
bound at these budgets); and ``graphs`` (``auto``, the default: as ``tiers.gpu.prefill_graphs`` says, on with CUDA;
``on`` or ``off``: whole-layer calls replay their plan and windows as graphs, ``whole_graphs``,
or not) and ``copies`` (``batch``, the default: a streamed part's copies go up as one batch,
``BATCHED_COPIES``; ``each``: one copy per bf16 expert and tensor, or per run of INT8 blobs);
every config's model is loaded up front and
each repetition runs them in turn, after the untiered model, so a host whose speed drifts within
the run weighs on all alike. Per repetition and config, one prefill is timed plain (``prefill_s``,
against the untiered model's of that repetition), then once more with marks: a host clock
reading and a CUDA timing event at each decoder layer's start, each experts call's start, the
return of its route sync, each streamed part's copies (events on the copy stream, the first one
queued after the part's wait for its half), each part's kernels (compute stream) and the call's
end. Per streamed layer (medians over layers, then over repetitions):

- ``copy_ms``: the copy stream's busy time on the layer's parts; ``copy_gaps_ms``: its idle time
  between the layer's parts; ``parts``: their number;
- ``boundary_ms``: the copy stream's idle time from the previous layer's last copy (or read-ahead)
  to this layer's first, split into ``boundary_gpu_ms`` (until the route sync returned: the last
  kernels, attention, router and the sync) and ``boundary_plan_ms`` (from there to the first copy:
  the host planning and queuing the call);
- ``tail_ms``: device time from the layer's last copy to its experts call's end;
- ``kernel_ms``: device time from each part's wait for its reads to its kernels' end, summed;
- ``host_attn_ms``, ``host_route_ms``, ``host_call_ms``: host time before the experts call, in the
  route (mostly waiting for the sync) and in the rest of the call;
- ``host_layer_ms``, ``device_layer_ms``: from the layer's start to the next one's, on each clock
  (also for the untiered model, under ``all_gpu``, with ``host_experts_ms``).

Host time per layer in the engine's steps (``host_steps_ms``, with ``host_step_calls`` per layer),
over the marked prefill: the route, the streamed call's plan, parts, waits and uploads, the
stacked dequantizations, the grouped GEMMs' launches, read-aheads.

Totals per prefill: ``device_ms`` (first layer to last experts call on the device), ``copy_ms`` and
``copy_busy`` (the copy stream's share of ``device_ms``), and ``boundary_ms``/``copy_gaps_ms`` summed
over layers, so ``device_ms`` ≈ copies + gaps + boundaries + the first layer's lead + the last tail.

The untiered model's kernel time, under the profiler (``all_gpu.kernels``): in its experts calls and
outside them. Per config, ``dependency_bound_s``: the kernels outside the experts calls plus the
moved bytes at 55 GB/s, the least a prefill whose calls wait for their routing can take, and
``over_dependency_bound``.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

from tiers.tools.bench_bounds import H2D_BYTES_PER_S  # noqa: E402  (the bench's bounds use the same rate)
from tiers.tools.timeline import Marks, hook_layers, marking, split  # noqa: E402


def kernel_split(model, ids: torch.Tensor, cuda: bool) -> dict:
    """The untiered model's kernel time in one prefill under the profiler, in its experts calls
    and outside them (ms, summed over kernels, so the host's launch gaps are not in it; on the CPU,
    where ops run as they are called, their CPU time instead), and how many experts calls it saw.

    Why: a call that waits for its routing cannot read its layer's experts before that layer's
    attention and router have run, and the next layer cannot start before those reads land, so no
    schedule that reads only the routed experts, without predicting them, runs a prefill faster
    than the kernels outside the experts calls plus the reads (``dependency_bound_s``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    open_ranges: list = []

    def enter(m, a):
        r = record_function("prefill_split.experts")
        r.__enter__()
        open_ranges.append(r)

    def leave(m, a, o):
        open_ranges.pop().__exit__(None, None, None)
    undo = []
    for layer in model.model.layers:
        undo.append(layer.mlp.experts.register_forward_pre_hook(enter).remove)
        undo.append(layer.mlp.experts.register_forward_hook(leave).remove)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof, torch.no_grad():
            with record_function("prefill_split.prefill"):
                model(ids)
            if cuda:
                torch.cuda.synchronize()
    finally:
        for u in undo:
            u()

    def us(e) -> float:
        return e.device_time_total if cuda else e.cpu_time_total
    # the ranges as the host saw them (with CUDA, each range is also an annotation on the device's
    # timeline, whose time is its span, idle gaps included)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    total = sum(us(e) for e in events if e.name == "prefill_split.prefill") / 1e3
    calls = [us(e) / 1e3 for e in events if e.name == "prefill_split.experts"]
    return {"kernel_ms": total, "experts_kernel_ms": sum(calls), "other_kernel_ms": total - sum(calls), "experts_calls": len(calls)}


def dependency_bound_s(kernels: dict, moved_bytes: float) -> float:
    """The kernels outside the experts calls, then the reads at ``H2D_BYTES_PER_S``, one after
    the other (``kernel_split``)."""
    return kernels["other_kernel_ms"] / 1e3 + moved_bytes / H2D_BYTES_PER_S


ROUTES = ("uniform", "skewed", "rebal", "rebal-frozen")


def parse_spec(spec: str) -> dict:
    """``precision:staging:depth:fraction[:whole[:buffers[:plan[:dequant[:route[:graphs[:copies]]]]]]]`` -> its
    fields, the optional ones defaulted; a field outside its choices is refused, naming the spec."""
    fields = spec.split(":")
    if not 4 <= len(fields) <= 11:
        raise SystemExit(f"{spec}: expected 4 to 11 ':'-separated fields, got {len(fields)}")
    precision, staging, depth, fraction, *rest = fields
    defaults = ["auto", "", "copy", "kernel", "uniform", "auto", "batch"]
    whole, buffers, plan, dequant, route, graphs, copies = (rest + defaults[len(rest):])[:7]
    for name, value, allowed in (("whole", whole, ("auto", "on", "off")), ("plan", plan, ("copy", "compute")),
                                 ("dequant", dequant, ("kernel", "torch")), ("route", route, ROUTES),
                                 ("graphs", graphs, ("auto", "on", "off")), ("copies", copies, ("batch", "each"))):
        if value not in allowed:
            raise SystemExit(f"{spec}: the {name} field is one of {', '.join(allowed)}, not {value!r}")
    return {"precision": precision, "staging": staging, "depth": depth, "fraction": float(fraction), "whole": whole,
            "buffers": int(buffers) if buffers else None, "plan": plan, "dequant": dequant, "route": route, "graphs": graphs,
            "copies": copies}


# the engine's steps timed on the host (TierManager attributes)
STEPS = ("begin_call", "begin_stream", "stream_part", "wait_part", "end_part", "end_stream", "upload_int_lists",
         "_stage_copy_run", "_stage_copy_batch", "_dequantize", "wait_all", "prefetch", "read_ahead", "stage_ahead", "note_used", "note_prediction",
         "settle", "defer_whole")


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default="int8:auto:0:0.25,int8:auto:0:0.5",
                    help="comma-separated precision:staging_slots:prefetch_depth:gpu_fraction")
    ap.add_argument("--rebalance-every", type=int, default=8, help="rebal routes: rebalance every this many tokens (as tools/bench.py)")
    ap.add_argument("--warm-generates", type=int, default=16, help="rebal routes: decode generates of 33 tokens before timing")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _all_gpu(plain, ids, cuda: bool) -> dict:
    """The untiered model's host time per layer, before and in its experts calls, and its kernels."""
    marks = Marks(cuda)  # the untiered model's host time per layer, before and in its experts calls
    undo = hook_layers(plain, marks)
    with torch.no_grad():
        marks.on = True
        plain(ids)
        marks.on = False
    for u in undo:
        u()
    out = split(marks.resolved())["median"]
    out["host_experts_ms"] = statistics.median(
        b[2] - a[2] for a, b in zip(marks.resolved(), marks.resolved()[1:]) if a[0] == "experts" and b[0] == "experts_end")
    out["kernels"] = kernel_split(plain, ids, cuda)
    return out


def _report(result: dict, loaded: dict, reps: dict, layouts: dict, n_experts: int) -> None:
    """Each config's medians over the repetitions into ``result``, printed as they are."""
    from experiments.hot_layout import layout_summary

    for spec, (cfg, m, mgr, _) in loaded.items():
        r = reps[spec]
        med = {k: statistics.median(x[k] for x in r) for k in ("prefill_s", "all_gpu_prefill_s", "moved_bytes", "bound_s")}
        med["over_bound"] = med["prefill_s"] / med["bound_s"]
        med["dependency_bound_s"] = dependency_bound_s(result["all_gpu"]["kernels"], med["moved_bytes"])
        med["over_dependency_bound"] = med["prefill_s"] / med["dependency_bound_s"]
        med["prefetch"] = r[-1]["prefetch"]
        med["timeline"] = r[-1]["timeline"]
        for r_ in r:
            del r_["timeline"]
        for part in ("median", "total", "host_steps_ms", "host_step_calls"):
            keys = sorted({k for x in r for k in x[part]})
            med[part] = {k: statistics.median(x[part][k] for x in r if k in x[part]) for k in keys}
        pool = mgr.pool_of[min(mgr.pool_of)]
        result["configs"][spec] = {"config": cfg, "staging_slots": pool.n_slots - mgr.hot_count[id(pool)], "median": med, "reps": r,
                                   "whole_graphs": mgr.whole_graphs.counts()}
        if spec in layouts:
            result["configs"][spec]["layout"] = layouts[spec] | {"end": layout_summary(mgr.table, sorted(mgr.manifest.layers), n_experts)}
            if mgr.rebalancer is not None:
                result["configs"][spec]["rebalancer"] = mgr.rebalancer.report()
            print("   layout", json.dumps(result["configs"][spec]["layout"]), flush=True)
        print(spec, json.dumps({k: v for k, v in med.items() if not isinstance(v, (dict, list))}), json.dumps(med["prefetch"]),
              json.dumps(mgr.whole_graphs.counts()), flush=True)
        for part in ("total", "median", "host_steps_ms", "host_step_calls"):
            print("  ", part, json.dumps({k: round(v, 3) for k, v in med[part].items()}), flush=True)
        mgr.close()


def _load_all(specs: dict, args, packed, device, ids, prompt, n_experts: int) -> tuple[dict, dict]:
    """Every config's model, loaded up front (each repetition runs them all in turn), warmed up,
    and the hot slots' layout of those that follow a trace."""
    import tiers
    from experiments.hot_layout import layout_summary
    from tiers.graphs import DecodeGraphs
    from tiers.integration import manager_of
    from tiers.quant import int8 as int8_scheme
    from tiers.tools.measure import prefill_seconds, warm_config
    from tiers.tools.routing import TraceRouting

    loaded = {}  # every config's model, loaded up front: each repetition runs them all in turn
    layouts = {}
    for spec, f in specs.items():
        cfg = warm_config(f["precision"], f["staging"], f["depth"], f["fraction"])
        if f["route"].startswith("rebal"):
            cfg["tiers"]["rebalance"] = {"every_tokens": args.rebalance_every}
        m = tiers.load(packed, cfg, device=device, progress=False)
        mgr = manager_of(m)
        if f["whole"] == "on":
            mgr.WHOLE_LAYER_USED = 0.0  # whatever share of its warm experts the last long call used
        elif f["whole"] == "off":
            mgr.whole_calls = False
        if f["buffers"]:
            mgr.WHOLE_BUFFERS = f["buffers"]
        mgr.WHOLE_PLAN_ON_COPY = f["plan"] == "copy"
        mgr.BATCHED_COPIES = f["copies"] == "batch"
        if f["graphs"] != "auto" and (f["graphs"] == "on") != mgr.whole_graphs.enabled:
            mgr.whole_graphs = DecodeGraphs(device, f["graphs"] == "on")
        int8_scheme.USE_KERNEL = f["dequant"] == "kernel"
        if f["route"] != "uniform":  # stays on for the run: each call takes the trace's next rows
            TraceRouting(m, tokens=max(4096, 2 * args.prefill))
            layers = sorted(mgr.manifest.layers)
            layouts[spec] = {"load": layout_summary(mgr.table, layers, n_experts)}
            if f["route"].startswith("rebal"):
                for _ in range(args.warm_generates):
                    m.generate(prompt, max_new_tokens=33, min_new_tokens=33, do_sample=False, pad_token_id=0)
            if f["route"] == "rebal-frozen":
                mgr.settle()
                mgr.rebalancer.land(wait=True)
                mgr.rebalancer.window.every = 1 << 62  # no interval closes from here on
            layouts[spec]["timed"] = layout_summary(mgr.table, layers, n_experts)
        prefill_seconds(m, ids, device, 1)  # warm-up (the cache settles)
        loaded[spec] = (cfg, m, mgr, f["dequant"] == "kernel")
    return loaded, layouts


def main() -> int:
    args = _args()
    specs = {spec: parse_spec(spec) for spec in args.configs.split(",")}  # a bad spec is refused before anything runs

    import tiers.integration as integration
    from experiments.decode_split import Steps
    from tiers.quant import int8 as int8_scheme
    from tiers.tools.measure import build_packed, prefill_seconds, scratch_dir, shape_of, write_result

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    work = scratch_dir("tiers-prefill-split-")
    plain, packed = build_packed(args.model, args.layers, device, work)
    ids = torch.randint(0, plain.config.vocab_size, (1, args.prefill), generator=torch.Generator().manual_seed(1)).to(device)
    prompt = ids[:, :16]  # the rebal routes' decode generates
    result = {"command": "python experiments/prefill_split.py " + " ".join(sys.argv[1:]), "model": args.model,
              "shape": shape_of(args.model, args.layers, device), "prefill_tokens": args.prefill,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "configs": {}}
    prefill_seconds(plain, ids, device, 1)
    result["all_gpu"] = _all_gpu(plain, ids, cuda)
    print("all_gpu", json.dumps({k: round(v, 3) for k, v in result["all_gpu"].items() if not isinstance(v, dict)}),
          json.dumps(result["all_gpu"]["kernels"]), flush=True)
    n_experts = getattr(plain.config, "num_local_experts", None) or plain.config.num_experts
    loaded, layouts = _load_all(specs, args, packed, device, ids, prompt, n_experts)
    reps = {spec: [] for spec in loaded}
    for _ in range(args.reps):
        gpu = prefill_seconds(plain, ids, device, 1)
        for spec, (cfg, m, mgr, kernel) in loaded.items():
            int8_scheme.USE_KERNEL = kernel
            mgr.reset_stats()
            t = prefill_seconds(m, ids, device, 1)
            st = mgr.stats()
            moved = sum(st.bytes_moved.values()) / 2  # prefill_seconds warms up once
            ahead = {k: st.prefetch[k] for k in ("issued", "used", "accuracy", "wasted_bytes")}  # over both
            marks = Marks(cuda)
            steps = Steps()
            with marking(m, mgr, marks):
                for attr in (a for a in STEPS if hasattr(mgr, a)):
                    steps.wrap(mgr, attr, attr)
                for attr in ("_route", "_run_windows", "_grouped_whole", "_whole_plan"):
                    steps.wrap(integration, attr, attr)
                try:
                    with torch.no_grad():
                        m(ids)
                finally:
                    steps.restore()
            s = split(marks.resolved())
            s["host_steps_ms"] = {k: v / args.layers for k, v in steps.ms.items()}
            s["host_step_calls"] = {k: v / args.layers for k, v in steps.calls.items()}
            # the marks themselves (what, layer, device ms from the first), for the last repetition
            s["timeline"] = [(w, L, round(d, 3)) for w, L, _, d in marks.resolved()]
            reps[spec].append({"prefill_s": t, "all_gpu_prefill_s": gpu, "moved_bytes": moved, "prefetch": ahead,
                               "bound_s": max(gpu, moved / H2D_BYTES_PER_S)} | s)
    int8_scheme.USE_KERNEL = True
    _report(result, loaded, reps, layouts, n_experts)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
