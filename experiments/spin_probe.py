"""Do threads that wait on CUDA events slow the serving thread's host work?

    python experiments/spin_probe.py [--reps 15] [--launches 3000] [--wait-ms 20] --out FILE

The serving thread times two host-bound workloads: ``--launches`` small kernel launches (what an
untiered model's decode spends its host time on) and a pure-Python loop. Meanwhile 0, 1 or 2
background threads each queue ``--wait-ms`` of GPU sleep on a stream of their own and wait for
an event recorded after it, over and over, as the rebalancer's threads wait for their fences:
``spin`` with a default event (``cudaEventSynchronize`` may spin a core for the whole wait),
``blocking`` with ``Event(blocking=True)`` (the thread sleeps until the event fires), ``poll``
querying the event every 0.5 ms in between sleeps. Rounds alternate the modes, so a slow phase of
the host moves them alike; medians over ``--reps`` rounds, per mode and thread count, and each
background thread's CPU seconds per second of wall time.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

MODES = ("none", "spin", "blocking", "poll")


def _waiter(mode: str, stop: threading.Event, cycles: int, cpu: list[float]) -> None:
    stream = torch.cuda.Stream()
    t0 = time.thread_time()
    while not stop.is_set():
        ev = torch.cuda.Event(blocking=(mode == "blocking"))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        ev.record(stream)
        if mode == "poll":
            while not ev.query():
                time.sleep(0.0005)
        else:
            ev.synchronize()
    cpu.append(time.thread_time() - t0)


def _launches(x: torch.Tensor, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host


def _python(n: int) -> float:
    t0 = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return time.perf_counter() - t0


def _cycles_per_ms() -> float:
    """GPU sleep cycles per ms of device time, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 10_000_000
    torch.cuda._sleep(n)  # warm
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / start.elapsed_time(end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--launches", type=int, default=3000)
    ap.add_argument("--loop", type=int, default=300_000, help="iterations of the pure-Python loop")
    ap.add_argument("--wait-ms", type=float, default=20.0, help="GPU sleep each background wait covers")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("spin_probe: needs CUDA (it times waits on CUDA events)")
    x = torch.zeros(16, device="cuda")
    cycles = int(_cycles_per_ms() * args.wait_ms)
    counts = [int(t) for t in args.threads.split(",")]
    configs = [("none", 0)] + [(m, k) for k in counts for m in MODES[1:]]
    times: dict[str, dict[str, list[float]]] = {f"{m}x{k}": {"launch_ms": [], "python_ms": [], "thread_cpu_share": []} for m, k in configs}
    _launches(x, args.launches), _python(args.loop)  # warm
    for _ in range(args.reps):
        for mode, k in configs:
            row = times[f"{mode}x{k}"]
            stop, cpu = threading.Event(), []
            threads = [threading.Thread(target=_waiter, args=(mode, stop, cycles, cpu)) for _ in range(k)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            time.sleep(0.005)  # the waiters are waiting
            row["launch_ms"].append(1e3 * _launches(x, args.launches))
            row["python_ms"].append(1e3 * _python(args.loop))
            stop.set()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            if k:
                row["thread_cpu_share"].append(sum(cpu) / k / wall)
    summary = {name: {key: statistics.median(v) for key, v in row.items() if v} for name, row in times.items()}
    result = {"command": "python experiments/spin_probe.py " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cpus": os.cpu_count(), "wait_ms": args.wait_ms, "median": summary, "rounds": times}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, row in summary.items():
        print(name, {k: round(v, 3) for k, v in row.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
