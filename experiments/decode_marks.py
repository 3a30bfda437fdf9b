"""Where does a decode step's time go beside its copies: in host-routed calls, direct calls, step graphs?

    PYTHONPATH=. python3 experiments/decode_marks.py [--model mixtral] [--layers 4] [--tokens 16]
                                                     [--arms tiers_25_int4,tiers_25_int4~direct]
                                                     [--kernels] [--steps] [--trace N] --out FILE

On a CUDA machine. Builds the model's shapes with random weights, packs the arms' precisions and
loads each arm as ``tools/bench.py`` does (``tools.bench_arms.tiers_config``). For each arm, the
decode ms/token of generate (median of 3, graphs as configured), then one generate with marks
(``tools.timeline.Marks``: host clock and CUDA events), per host-routed layer call of each decode
token after the first:

- ``sync_ms``: host time from the experts call's start to the routing sync's return;
- ``plan_ms``: host time from there to the first copy queued (cache, table, staging decisions);
- ``queue_ms``: host time from there to the call's end (the rest of the copies, kernels queued);
- ``gpu_idle_ms``: device time from the routing's end (the experts call's start on the compute
  stream) to the first copy's queueing on the copy stream, when neither engine works;
- ``copy_ms``: device time from that to the copy stream's end of the call's copies;
- ``tail_ms``: device time from the copies' end to the experts call's end (the last tensor's
  decode and the experts' products);
- ``between_ms``: device time from a call's end to the next call's start (the next layer's
  attention, norms and router).

Every arm records its step graphs' counts, the host time of each step graph's launch (``replay()``,
no profiler: ``launch_ms``, median and count), its greedy tokens and each step's raw logit sum
(bitwise: where two arms part) and top-2 margin, so a failed capture or a changed answer shows.
``~foreach`` arms set the step's length counters with one ``torch._foreach_copy_`` kernel instead
of a device copy per layer; ``~shared`` arms make the counters views of one tensor, set by one
copy kernel. An unknown ``~word`` (``~r2``) repeats an arm under another name. With a
``tiers_100_bf16`` arm in the run, every other arm's ``bound_ratio`` is its decode over all-hot's
plus its bytes at 55 GB/s.

``~direct`` arms run every decode stage direct (``DirectPath.MISS_BYTES`` unbounded); their step
graphs hide the layers, so they are timed as a whole unless ``~nograph`` turns graphs off. Then
each direct call gives ``fetch_ms`` (device time of its plan and fetch launches, which read its
misses), ``products_ms`` (from there to the call's end) and ``between_ms``; the rate of the
fetches is the arm's bytes per call over ``fetch_ms`` (``fetch_gb_s``).

Options for arms run as step graphs, where the marks see nothing: ``--kernels`` gives each
kernel's device time per decode token (torch's profiler, which CUPTI feeds with the kernels a graph
replays), the time some engine was busy, and the idle time by the pair of events around it;
``--steps`` each decode step's wall time and a cProfile of a generate; ``--trace N`` the host's
``cudaGraphLaunch`` time for each step graph and when the device starts it (the raw events beside
the output file, not kept in the repository).
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402


def instrument(model, mgr, marks) -> list:
    """Marks of each host-routed call: the experts call's start and end, the sync's return, the
    first copy queued and the batch's close (copy stream); returns the undo callables."""
    from tiers.tools.timeline import hook_layers, wrap_call

    undo = hook_layers(model, marks)
    staging = mgr.staging
    first = [True]

    def routed(*_a, **_k):
        marks.mark("routed", marks.layer)
        first[0] = True

    def write(*_a, **_k):
        if first[0]:
            marks.mark("copy_q", marks.layer, staging.copy_stream)
            first[0] = False

    def mark(what: str, stream=None):
        return lambda *_a, **_k: marks.mark(what, marks.layer, stream)

    undo += [wrap_call(mgr, "count_call", before=routed),
             wrap_call(mgr.direct, "_fetch", before=mark("fetch"), after=mark("fetch_end")),
             wrap_call(staging, "write", before=write),
             wrap_call(staging, "_close", after=mark("copy_end", staging.copy_stream))]
    return undo


def split(resolved: list, layers: int) -> dict:
    """Medians over the host-routed calls of the tokens after the first, as the module docstring says."""
    tokens, cur = [], None
    for w, L, h, d in resolved:
        if w == "layer" and L == 0:
            cur = []
            tokens.append(cur)
        if cur is not None:
            cur.append((w, L, h, d))
    rows = []
    for tok in tokens[1:]:
        by = {}
        for w, L, h, d in tok:
            by.setdefault(L, {}).setdefault(w, (h, d))
        for L in range(layers):
            m = by.get(L, {})
            if all(k in m for k in ("experts", "routed", "copy_q", "copy_end", "experts_end")):  # host-routed
                row = {"sync_ms": m["routed"][0] - m["experts"][0], "plan_ms": m["copy_q"][0] - m["routed"][0],
                       "queue_ms": m["experts_end"][0] - m["copy_q"][0], "gpu_idle_ms": m["copy_q"][1] - m["experts"][1],
                       "copy_ms": m["copy_end"][1] - m["copy_q"][1], "tail_ms": m["experts_end"][1] - m["copy_end"][1]}
            elif all(k in m for k in ("experts", "fetch", "fetch_end", "experts_end")):  # direct, graphs off
                row = {"fetch_ms": m["fetch_end"][1] - m["fetch"][1], "products_ms": m["experts_end"][1] - m["fetch_end"][1]}
            else:
                continue
            nxt = by.get(L + 1, {}).get("experts")
            if nxt is not None:
                row["between_ms"] = nxt[1] - m["experts_end"][1]
            rows.append(row)
    if not rows:
        return {"calls": 0}
    keys = sorted({k for r in rows for k in r})
    return {"calls": len(rows)} | {k: round(statistics.median(r[k] for r in rows if k in r), 4) for k in keys}


def kernels(m, prompt, tokens: int) -> dict:
    """Device time per decode token of each kernel and copy, by torch's profiler (CUPTI reports the
    kernels a graph replays): a generate of ``tokens`` less one of 1 (its prefill), over ``tokens - 1``;
    the top 14 by time, their sum, the time some engine was busy (the union of their intervals) and
    the wall time."""
    runs = [_profiled(m, prompt, n) for n in (1, tokens)]
    n = tokens - 1
    by = {k: [v[0] - runs[0][0].get(k, [0, 0])[0], v[1] - runs[0][0].get(k, [0, 0])[1]] for k, v in runs[1][0].items()}
    top = sorted(by.items(), key=lambda kv: -kv[1][0])
    work = [kv for kv in top if not kv[0].startswith("idle: ")]
    idle = [kv for kv in top if kv[0].startswith("idle: ")]
    return {"wall_ms_per_token": round((runs[1][2] - runs[0][2]) / n, 3), "device_ms_per_token": round(sum(v[0] for _, v in work) / n, 3),
            "busy_ms_per_token": round((runs[1][1] - runs[0][1]) / n, 3),
            "top": {k: [round(v[0] / n, 4), round(v[1] / n, 1)] for k, v in work[:14]},
            "idle_top": {k: [round(v[0] / n, 4), round(v[1] / n, 1)] for k, v in idle[:12]}}


def steps(m, prompt, tokens: int) -> dict:
    """Wall ms of each decode step of one generate (a logits processor syncs and stamps each step's
    end), the generate's wall ms, and where its host time went (cProfile of a second generate: the
    25 functions of most own time, and the tiers functions of most cumulative time)."""
    import cProfile
    import io
    import pstats

    from transformers import LogitsProcessor, LogitsProcessorList

    stamps = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            sync()
            stamps.append(time.perf_counter())
            return scores

    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    sync()
    t0 = time.perf_counter()
    m.generate(prompt, logits_processor=LogitsProcessorList([Stamp()]), **kw)
    sync()
    t1 = time.perf_counter()
    step_ms = [round((b - a) * 1e3, 3) for a, b in zip(stamps, stamps[1:])]
    prof = cProfile.Profile()
    prof.enable()
    m.generate(prompt, **kw)
    sync()
    prof.disable()
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).sort_stats(key)
        st.print_stats(*(("tiers", 25) if key == "cumulative" else (25,)))
        out[key] = [line for line in buf.getvalue().splitlines() if line.strip()][-27:]
    return {"generate_ms": round((t1 - t0) * 1e3, 2), "prefill_to_first_ms": round((stamps[0] - t0) * 1e3, 2),
            "after_last_ms": round((t1 - stamps[-1]) * 1e3, 2), "step_ms": step_ms,
            "step_median_ms": round(statistics.median(step_ms), 3), "profile": out}


def trace(m, prompt, tokens: int, path: str) -> dict:
    """Every CUDA event and CUDA runtime call of one generate of ``tokens`` (torch's profiler, host
    and device), as rows (on, name, start us from the first, duration us, stream), to ``path``;
    returns, for each step graph's launch, the host time of ``cudaGraphLaunch``, the time from its
    start to the first device event after it (and that event's name), and the device events' count
    until the next launch."""
    import json

    events, _ = _generate_events(m, prompt, tokens, host=True)
    rows = []
    for e in events:
        dev = e.device_type() == torch.autograd.DeviceType.CUDA
        if dev or e.name().startswith("cuda"):
            rows.append(("gpu" if dev else "cpu", e.name()[:60], e.start_ns(), e.duration_ns(), e.device_resource_id() if dev else 0))
    t0 = min(r[2] for r in rows)
    rows = sorted(((on, n, round((a - t0) / 1e3, 2), round(d / 1e3, 2), res) for on, n, a, d, res in rows), key=lambda r: r[2])
    Path(path).write_text(json.dumps(rows))
    launches = [r for r in rows if r[0] == "cpu" and r[1] == "cudaGraphLaunch"]
    out = []
    for i, (_, _, at, dur, _) in enumerate(launches):
        end = launches[i + 1][2] if i + 1 < len(launches) else float("inf")
        dev = [r for r in rows if r[0] == "gpu" and at <= r[2] < end]
        if dev:
            out.append({"launch_us": dur, "first_device_us": round(dev[0][2] - at, 1), "first": dev[0][1][:30], "device_events": len(dev)})
    return {"launches": out}


def _generate_events(m, prompt, tokens: int, host: bool) -> tuple[list, float]:
    """The profiler's events of one generate of ``tokens`` (device events, and with ``host`` the
    host's too: CUDA runtime calls among them) and its wall seconds."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        m.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return list(prof.profiler.kineto_results.events()), wall


def _profiled(m, prompt, tokens: int) -> tuple[dict, float, float]:
    """One generate of ``tokens`` under the profiler: ms and count by kernel name, busy ms, wall ms."""
    events, wall = _generate_events(m, prompt, tokens, host=False)
    by: dict[str, list] = {}
    spans = []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            got = by.setdefault(e.name()[:70], [0.0, 0])
            got[0] += e.duration_ns() / 1e6
            got[1] += 1
            spans.append((e.start_ns(), e.end_ns(), e.name()[:40]))
    busy, reach, last = 0, None, None
    for a, b, name in sorted(spans):
        if reach is not None and a > reach:  # idle from the end of ``last`` to ``name``
            gap = by.setdefault(f"idle: {last} -> {name}", [0.0, 0])
            gap[0] += (a - reach) / 1e6
            gap[1] += 1
        if reach is None or a > reach:
            busy, reach, last = busy + b - a, b, name
        elif b > reach:
            busy, reach, last = busy + b - reach, b, name
    return by, busy / 1e6, wall * 1e3


@contextlib.contextmanager
def replay_times():
    """The host milliseconds of each CUDA graph ``replay()`` meanwhile (the launch; the device
    starts a step graph when it returns), in a list."""
    times, replay = [], torch.cuda.CUDAGraph.replay

    def timed(graph):
        t0 = time.perf_counter()
        replay(graph)
        times.append((time.perf_counter() - t0) * 1e3)

    torch.cuda.CUDAGraph.replay = timed
    try:
        yield times
    finally:
        torch.cuda.CUDAGraph.replay = replay


def run_arm(name: str, args, packed: Path, expert_bytes: int, prompt, top_k: int, device: torch.device) -> dict:
    import tiers
    from tiers.api import manager_of
    from tiers.paths.direct import DirectPath
    from tiers.tools.bench_arms import tiers_config
    from tiers.tools.measure import decode_ms_per_token
    from tiers.tools.timeline import Marks

    base, _, variant = name.partition("~")
    flags = SimpleNamespace(staging_slots="auto", graphs="on", rebalance_every=0)
    cfg = tiers_config(base, flags, expert_bytes, packed, top_k)
    was = DirectPath.MISS_BYTES
    variants = set(variant.split("~")) - {""}
    if "nograph" in variants:
        cfg["tiers"]["gpu"]["graphs"] = False
    if "direct" in variants:
        DirectPath.MISS_BYTES = float("inf")
    from tiers.graphs import step_graphs

    set_lengths = step_graphs.set_lengths
    if "foreach" in variants:  # the step's length counters set by one kernel, not a device copy per layer
        step_graphs.set_lengths = _foreach_lengths
    if "shared" in variants:  # the counters made views of one tensor, set by one small copy kernel
        step_graphs.set_lengths = _shared_lengths
    try:
        m = tiers.load(packed, cfg, device=device, progress=False)
        mgr = manager_of(m)
        if device.type == "cpu" and "direct" in variants:  # a smoke run: the torch reference stands in for the kernel
            mgr.batched_decode = mgr.staging.direct_reads = mgr.direct.enabled = True
        m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        ms = decode_ms_per_token(m, prompt, args.tokens, device, 3)
        captures = tiers.stats(m).as_dict().get("step_graphs")  # the warm-up's and timing's: captures, failures
        mgr.reset_stats()
        with replay_times() as launches:
            out = m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        stats = tiers.stats(m)
        moved = sum(stats.bytes_moved.values()) / args.tokens
        row = {"decode_ms_per_token": round(ms, 3), "mib_moved_per_token": round(moved / 2**20, 1),
               "bytes_ms_per_token": round(moved / 55e9 * 1e3, 3), "step_graphs_timed": captures,
               "tokens": out.sequences[0, prompt.shape[1]:].tolist(),
               "launch_ms": [round(statistics.median(launches), 4) if launches else None, len(launches)],
               "logit_sums": [s.double().sum().item() for s in out.logits],  # bitwise: where two arms' logits part
               "margins": [round((lambda t: (t[0] - t[1]).item())(s[0].float().topk(2).values), 4) for s in out.logits]}
        if "direct" not in variants or "nograph" in variants:
            marks = Marks(device.type == "cuda")
            undo = instrument(m, mgr, marks)
            marks.on = True
            m.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
            marks.on = False
            for u in reversed(undo):
                u()
            row["calls"] = split(marks.resolved(), args.layers)
            if row["calls"].get("fetch_ms", 0) > 0:
                row["fetch_gb_s"] = round(moved / args.layers / row["calls"]["fetch_ms"] / 1e6, 1)
        if args.trace:
            row["trace"] = trace(m, prompt, args.trace, f"{args.out}.{name}.trace.json")
        if args.steps:
            row["steps"] = steps(m, prompt, args.tokens)
        if args.kernels and device.type == "cuda":
            row["kernels"] = kernels(m, prompt, args.tokens)
        mgr.close()
        return row
    finally:
        DirectPath.MISS_BYTES = was
        step_graphs.set_lengths = set_lengths


def _foreach_lengths(cache, position: torch.Tensor) -> None:
    from tiers.graphs.step_graphs import counted_layers

    lengths = [layer.cumulative_length for layer in counted_layers(cache)]
    if lengths:
        torch._foreach_copy_(lengths, [position.reshape(t.shape) for t in lengths])


def _shared_lengths(cache, position: torch.Tensor) -> None:
    """The layers' scalar counters rebound, at the first (eager) step of a cache, to views of one
    tensor, which then takes the position by one copy from an expanded (so not memcpy-able) source."""
    from tiers.graphs.step_graphs import counted_layers

    layers = counted_layers(cache)
    if not layers:
        return
    shared = getattr(cache, "_marks_lengths", None)
    if shared is None or any(layer.cumulative_length.data_ptr() != shared[i].data_ptr() for i, layer in enumerate(layers)):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the shared length counters must be made outside a capture")
        shared = torch.stack([layer.cumulative_length.reshape(()) for layer in layers])
        for i, layer in enumerate(layers):
            layer.cumulative_length = shared[i]
        cache._marks_lengths = shared
    shared.copy_(position.reshape(1).expand(len(layers)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--arms", default="tiers_100_bf16,tiers_25_int4,tiers_25_int4~direct")
    ap.add_argument("--kernels", action="store_true", help="each arm's kernels' device time per token (torch's profiler)")
    ap.add_argument("--steps", action="store_true", help="each arm's wall time by decode step, and a cProfile of a generate")
    ap.add_argument("--trace", type=int, default=0, help="write each arm's CUDA events and runtime calls of a generate of this many tokens")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a smoke run of the script itself")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")

    from tiers.loader.pack import pack
    from tiers.tools.bench_arms import arm_precisions
    from tiers.tools.measure import SHAPES, TINY, build, expert_bytes_of, write_result

    shape = dict((TINY if args.tiny else SHAPES)[args.model], layers=args.layers)
    model = build(args.model, shape, device)
    expert_bytes, top_k = expert_bytes_of(model), model.config.num_experts_per_tok
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    arms = args.arms.split(",")
    work = Path(tempfile.mkdtemp(prefix="tiers-marks-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    model.save_pretrained(work / "hf")
    del model
    pack(work / "hf", work / "packed", precisions=arm_precisions([a.split("~")[0] for a in arms]), overwrite=True, progress=False,
         device=device)
    result = {"command": "python3 experiments/decode_marks.py " + " ".join(sys.argv[1:]), "model": args.model, "shape": shape,
              "device": str(device) if args.tiny else torch.cuda.get_device_name(), "arms": {}}
    for name in arms:
        try:
            result["arms"][name] = run_arm(name, args, work / "packed", expert_bytes, prompt, top_k, device)
        except Exception as exc:  # noqa: BLE001 (one arm's failure, recorded; the other arms still run)
            result["arms"][name] = {"error": repr(exc)}
        print(name, result["arms"][name], flush=True)
        gc.collect()  # the arm's model and graphs gone before the next arm's capture, as tools/bench_run does
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_result(args.out, result)  # after each arm: a run cut short by its time limit keeps what it measured
    hot = result["arms"].get("tiers_100_bf16", {}).get("decode_ms_per_token")
    for name, row in result["arms"].items():  # the figure: decode over all-hot's plus its bytes at 55 GB/s
        if hot and "decode_ms_per_token" in row and not name.startswith("tiers_100_"):
            row["bound_ratio"] = round(row["decode_ms_per_token"] / (hot + row["bytes_ms_per_token"]), 3)
            print(name, "x", row["bound_ratio"], "of its bytes bound", flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
