"""Where does a decode step's extra time go when two all-GPU models step in turn? One condition
per fresh process (the effect ``bench/interleave_probe.py``, since deleted, found shows in a process's first
interleaved run only), each step of each model recorded with what could explain it:

- its wall time to the forward's return and to the device sync after it, and the serving
  thread's CPU time and minor page faults meanwhile (``tools.measure.thread_usage``);
- whether the model stepped right before it too (the order within a step alternates, so each
  model steps twice in a row every other step);
- Python's garbage collections during it, by generation, and the time they took (``gc.callbacks``);
- the CUDA caching allocator's device allocations and frees;
- the kernel's counters that move with memory work (``/proc/vmstat``: NUMA hinting faults and
  migrations, transparent huge pages, compaction, reclaim), where readable;

and, for ``--profile`` steps from ``--profile-from`` on, the functions that took the forward's
time (``cProfile``, by own time, the top 12).

    python experiments/step_probe.py [--model mixtral] [--layers 8] [--steps 96] [--order alternate|blocks]
        [--gc on|off] [--cudnn-sdpa on|off] [--profile 8] [--profile-from 40] --out FILE
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from tiers.tools import measure  # noqa: E402

VMSTAT = ("numa_hint_faults", "numa_pages_migrated", "pgmigrate_success", "thp_fault_alloc", "thp_collapse_alloc",
          "compact_stall", "compact_migrate_scanned", "pgscan_kswapd", "pgscan_direct", "pgfault", "pgmajfault")


def vmstat() -> dict:
    try:
        with open("/proc/vmstat") as f:
            pairs = (line.split() for line in f)
            return {k: int(v) for k, v in pairs if k in VMSTAT}
    except OSError:
        return {}


class GcClock:
    """Collections and their time since the last ``take``, by generation."""

    def __init__(self):
        self.t0, self.count, self.ms = 0.0, [0, 0, 0], [0.0, 0.0, 0.0]
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.ms[g] += (time.perf_counter() - self.t0) * 1e3

    def take(self) -> tuple[list[int], list[float]]:
        out = (self.count, [round(x, 3) for x in self.ms])
        self.count, self.ms = [0, 0, 0], [0.0, 0.0, 0.0]
        return out


def device_allocs(device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    s = torch.cuda.memory_stats(device)
    return s.get("num_device_alloc", 0), s.get("num_device_free", 0)


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--order", choices=("alternate", "blocks"), default="alternate",
                    help="alternate: the bench's interleaving; blocks: each model 8 steps at a time, the two in turn")
    ap.add_argument("--gc", choices=("on", "off"), default="on")
    ap.add_argument("--cudnn-sdpa", choices=("on", "off"), default="on",
                    help="off: take cuDNN out of torch's attention backends (torch.backends.cuda.enable_cudnn_sdp)")
    ap.add_argument("--profile", type=int, default=8, help="forwards profiled (cProfile), from --profile-from on")
    ap.add_argument("--profile-from", type=int, default=40)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _summary(steps: list[dict]) -> dict:
    """Medians of the timed (not profiled) steps, a model's repeated step apart from a switch."""
    timed = [r for r in steps if not r["profiled"]]
    by = {}
    for key, sel in (("repeat", lambda r: r["repeat"]), ("switch", lambda r: not r["repeat"])):
        rs = [r for r in timed if sel(r)]
        if rs:
            by[key] = {"n": len(rs), "host_ms_median": statistics.median(r["host_ms"] for r in rs),
                       "cpu_ms_median": statistics.median(r["cpu_ms"] for r in rs),
                       "faults_mean": statistics.fmean(r["faults"] for r in rs),
                       "gc_ms_sum": round(sum(sum(r["gc_ms"]) for r in rs), 3)}
    return by


def main() -> int:
    args = _args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.cudnn_sdpa == "off":
        torch.backends.cuda.enable_cudnn_sdp(False)
    shapes = measure.SHAPES if device.type == "cuda" else measure.TINY
    shape = dict(shapes[args.model], layers=args.layers)
    models = [measure.build(args.model, shape, device, seed=i) for i in range(2)]
    prompt = torch.randint(0, models[0].config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    if args.gc == "off":
        gc.disable()
    clock = GcClock()
    steps, profiles, last = [], [], None
    with torch.no_grad():
        state = []
        for m in models:
            out = m(input_ids=prompt, use_cache=True)
            state.append([out.logits[:, -1:].argmax(-1), out.past_key_values])
        for step in range(args.steps):
            if args.order == "alternate":
                order = (0, 1) if step % 2 == 0 else (1, 0)
            else:
                order = ((step // 8) % 2,)
            for i in order:
                tok, cache = state[i]
                measure.sync(device)
                clock.take()
                a0, v0, u0 = device_allocs(device), vmstat(), measure.thread_usage()
                prof = cProfile.Profile() if step >= args.profile_from and len(profiles) < args.profile else None
                t0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                out = models[i](input_ids=tok, use_cache=True, past_key_values=cache)
                if prof is not None:
                    prof.disable()
                host = time.perf_counter() - t0
                u1 = measure.thread_usage()
                state[i] = [out.logits[:, -1:].argmax(-1), out.past_key_values]
                measure.sync(device)
                total = time.perf_counter() - t0
                a1, v1 = device_allocs(device), vmstat()
                gcs, gcms = clock.take()
                rec = {"step": step, "model": i, "repeat": last == i, "host_ms": round(host * 1e3, 3), "total_ms": round(total * 1e3, 3),
                       "cpu_ms": round((u1[0] - u0[0]) * 1e3, 3), "faults": u1[2] - u0[2], "gc": gcs, "gc_ms": gcms,
                       "device_alloc": a1[0] - a0[0], "device_free": a1[1] - a0[1],
                       "vmstat": {k: v1[k] - v0[k] for k in v1 if v1[k] != v0.get(k)}, "profiled": prof is not None}
                steps.append(rec)
                last = i
                if prof is not None:
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
                    profiles.append({"step": step, "model": i, "repeat": rec["repeat"], "host_ms": rec["host_ms"], "top": s.getvalue()})
    gc.callbacks.remove(clock)
    gc.enable()
    by = _summary(steps)
    result = {"command": "python experiments/step_probe.py " + " ".join(sys.argv[1:]), "shape": shape, "device": str(device),
              "torch": torch.__version__, "summary": by, "steps": steps, "profiles": profiles}
    print(by, flush=True)
    for p in profiles[:4]:
        print(p["step"], p["model"], p["repeat"], p["host_ms"], "\n", p["top"][:2500], flush=True)
    measure.write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
