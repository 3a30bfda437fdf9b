"""Why does a decode step graph holding Triton kernels take longer to launch than one without?

    PYTHONPATH=. python3 experiments/graph_launch.py --out FILE

On a CUDA machine. Captures graphs of 900 small torch kernels and 12 device copies, alone
(``plain``) and with 12 launches of a small Triton kernel: through Triton (``triton``; reading
pinned host memory: ``triton_pinned``), through ``quant.launch``'s relauncher (``relaunch``),
through torch's static launcher, a plain ``cuLaunchKernel`` of a module loaded as inductor loads
it (``static``); the arms with the cubin loaded by ``cuLibraryLoadData`` are in this file at commit
22ff78d (answered: as slow, ``experiments/README.md``). ``/4`` captures the same work as 4 graphs sharing a pool, replayed in turn;
``~none`` leaves out the 12 copies and ``~foreach`` makes them one ``torch._foreach_copy_`` kernel;
``:N`` captures N small kernels instead of 900, ``+other`` replays a second graph after it. Kinds
beside Triton's, each launched 12 times among the small kernels: a jiterator (NVRTC) kernel
(``jiter``), a ``torch.cat`` of 40 tensors (parameters passed by value, ``cat``), a cuBLAS ``mv``,
a copy from pinned memory (``h2d``); ``triton1`` launches the Triton kernel once.
Times the host's first ``replay()`` (the launch, after which the device starts) and the replay's
wall time (median of 30), and names the device events of one replay (whether the driver ran the
copies as kernels, ``memcpy32_post``). Also records Triton's launcher's launch attribute lines.
"""
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _touch(src, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(src + i, mask=i < n, other=0), mask=i < n)


def _static(src, out):
    """The kernel launched by torch's static launcher (a plain ``cuLaunchKernel``), as inductor does."""
    import tempfile

    try:
        from torch._inductor.runtime import static_cuda_launcher as scl
    except ImportError:
        from torch._inductor.runtime import static_triton_launcher as scl
    k = _touch[(64,)](src, out, 1 << 16, BLOCK=1024)
    if not hasattr(k, "_cubin_path"):
        k._cubin_path = None
    sk = scl.StaticallyLaunchedCudaKernel(k)
    sk.reload_cubin_from_raw(tempfile.mktemp(suffix=".cubin"))
    sk.load_kernel(torch.cuda.current_device())
    return sk


def build(variant: str, parts: int = 1):
    variant, _, copying = variant.partition("~")  # the 12 copies: device copies, or ``~foreach`` one kernel, ``~none``
    variant, _, adds = variant.partition(":")  # ``:N`` small kernels instead of 900
    n = int(adds or 900)
    dev = torch.device("cuda")
    x = torch.zeros(4096, device=dev)
    w, v, mv_out = torch.randn(256, 256, device=dev), torch.randn(256, device=dev), torch.empty(256, device=dev)
    pieces, cat_out = [torch.ones(4, device=dev) for _ in range(40)], torch.empty(160, device=dev)
    pinned, landed = torch.ones(1024).pin_memory(), torch.empty(1024, device=dev)
    jit = torch.cuda.jiterator._create_jit_fn("template <typename T> T touch(T a) { return a; }") if variant == "jiter" else None
    small = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(13)]
    src = torch.ones(1 << 16, device=dev) if variant != "triton_pinned" else torch.ones(1 << 16).pin_memory()
    out = torch.empty(1 << 16, device=dev)
    from tiers.quant.launch import triton_relauncher

    re = triton_relauncher(_touch, dict(BLOCK=1024))
    static = _static(src, out) if variant == "static" else None

    def other(i):  # the kind's own launch among the small kernels: 12 of them, or one (``triton1``)
        if variant == "triton1" and i == 0:
            _touch[(64,)](src, out, 1 << 16, BLOCK=1024)
        elif variant not in ("plain", "triton1") and i % 75 == 0:
            if variant.startswith("relaunch"):
                re((64, 1), (src, out, 1 << 16), "k")
            elif variant == "static":
                static.run(64, 1, 1, torch.cuda.current_stream().cuda_stream, src, out, 1 << 16)
            elif variant == "jiter":
                out.copy_(jit(src))
            elif variant == "cat":
                torch.cat(pieces, out=cat_out)
            elif variant == "mv":
                torch.mv(w, v, out=mv_out)
            elif variant == "h2d":
                landed.copy_(pinned, non_blocking=True)
            else:
                _touch[(64,)](src, out, 1 << 16, BLOCK=1024)

    def step(span=range(n), copies=True):
        if copies and copying == "foreach":
            torch._foreach_copy_(small[1:], [small[0]] * 12)
        for s in small[1:] if copies and not copying else ():
            s.copy_(small[0])
        for i in span:
            x.add_(1)
            other(i)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graphs, pool = [], None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    bounds = [n * i // parts for i in range(parts + 1)]
    with torch.cuda.stream(s):
        for a, b in zip(bounds, bounds[1:]):
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=pool)
            step(range(a, b), copies=a == 0)
            g.capture_end()
            pool = g.pool()
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return graphs


def timed(graphs) -> dict:
    host, wall = [], []
    for r in range(40):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs[0].replay()
        t1 = time.perf_counter()
        for g in graphs[1:]:
            g.replay()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if r >= 10:
            host.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
    names = collections.Counter(e.name()[:30] for e in prof.profiler.kineto_results.events()
                                if e.device_type() == torch.autograd.DeviceType.CUDA)
    return {"launch_ms": round(statistics.median(host), 4), "wall_ms": round(statistics.median(wall), 4),
            "events": dict(names.most_common(6))}


ARMS = ("plain", "triton", "relaunch", "triton_pinned", "static", "triton/4", "plain/4", "triton~none", "triton~foreach",
        "plain~foreach", "plain:225", "plain:3600", "plain+other", "triton1", "jiter", "cat", "mv", "h2d")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", default=",".join(ARMS), help="a comma-separated subset of: " + ", ".join(ARMS))
    args = ap.parse_args()
    result = {"command": "python3 experiments/graph_launch.py " + " ".join(sys.argv[1:]), "triton": triton.__version__,
              "torch": torch.__version__, "device": torch.cuda.get_device_name(), "arms": {}}
    try:
        import inspect

        from triton.backends.nvidia import driver

        src = inspect.getsource(driver)
        result["launcher_attr_lines"] = [ln.strip() for ln in src.splitlines() if "ATTRIBUTE" in ln or "cuLaunchKernel" in ln][:30]
    except Exception as exc:  # noqa: BLE001
        result["launcher_attr_lines"] = repr(exc)
    for v in args.arms.split(","):
        try:
            name, _, parts = v.partition("/")
            name, _, also = name.partition("+")  # ``+other``: another graph of the same kind, replayed after it
            graphs = build(name, int(parts or 1))
            result["arms"][v] = timed(graphs + (build(name) if also else []))
        except Exception as exc:  # noqa: BLE001
            result["arms"][v] = repr(exc)
        print(v, result["arms"][v], flush=True)
    lines = result["launcher_attr_lines"]
    print("\n".join(lines) if isinstance(lines, list) else lines)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
