"""Why does a decode step graph holding Triton kernels take longer to launch than one without?

    PYTHONPATH=. python3 experiments/graph_launch.py --out FILE

On a CUDA machine. Captures graphs of 900 small torch kernels and 12 device copies, alone
(``plain``) and with 12 launches of a small Triton kernel: through Triton (``triton``; reading
pinned host memory: ``triton_pinned``), through ``quant.launch``'s relauncher (``relaunch``),
through torch's static launcher, a plain ``cuLaunchKernel`` of a module loaded as inductor loads
it (``static``), and through ``cuLaunchKernel`` of the cubin loaded with ``cuLibraryLoadData``, as
the CUDA runtime loads its own kernels (``library_kernel``: the ``CUkernel``; ``library_function``:
its ``CUfunction``; ``relaunch_library``: that ``CUfunction`` through the relauncher, that is
Triton's own launcher). ``/4`` captures the same work as 4 graphs sharing a pool, replayed in turn;
``~none`` leaves out the 12 copies and ``~foreach`` makes them one ``torch._foreach_copy_`` kernel.
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


class _Library:
    """The kernel's cubin loaded with ``cuLibraryLoadData`` (as the CUDA runtime loads its own
    kernels) and launched by ``cuLaunchKernel`` through ctypes, as a ``CUkernel`` (``handle``
    "kernel") or its context's ``CUfunction`` ("function")."""

    def __init__(self, src, out, handle: str):
        import ctypes

        from step_variants import library_function

        k = _touch[(64,)](src, out, 1 << 16, BLOCK=1024)
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.f = ctypes.c_void_p(library_function(k, function=handle == "function"))
        self.threads, self.shared = 32 * k.metadata.num_warps, k.metadata.shared
        extra = [n for n in ("global_scratch_size", "profile_scratch_size") if hasattr(k.metadata, n)]
        self.args = [ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int32(1 << 16)] + [ctypes.c_void_p(0) for _ in extra]
        self.params = (ctypes.c_void_p * len(self.args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in self.args])

    def run(self, stream: int) -> None:
        import ctypes

        r = self.cu.cuLaunchKernel(self.f, 64, 1, 1, self.threads, 1, 1, self.shared, ctypes.c_void_p(stream), self.params, None)
        assert r == 0, r


def build(variant: str, parts: int = 1):
    variant, _, copying = variant.partition("~")  # the 12 copies: device copies, or ``~foreach`` one kernel, ``~none``
    dev = torch.device("cuda")
    x = torch.zeros(4096, device=dev)
    small = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(13)]
    src = torch.ones(1 << 16, device=dev) if variant != "triton_pinned" else torch.ones(1 << 16).pin_memory()
    out = torch.empty(1 << 16, device=dev)
    from tiers.quant.launch import triton_relauncher

    re = triton_relauncher(_touch, dict(BLOCK=1024))
    static = _static(src, out) if variant == "static" else None
    lib = _Library(src, out, variant.split("_")[1]) if variant.startswith("library") else None

    def step(span=range(900), copies=True):
        if copies and copying == "foreach":
            torch._foreach_copy_(small[1:], [small[0]] * 12)
        for s in small[1:] if copies and not copying else ():
            s.copy_(small[0])
        for i in span:
            x.add_(1)
            if variant != "plain" and i % 75 == 0:
                if variant.startswith("relaunch"):
                    re((64, 1), (src, out, 1 << 16), "k")
                elif lib is not None:
                    lib.run(torch.cuda.current_stream().cuda_stream)
                elif variant == "static":
                    static.run(64, 1, 1, torch.cuda.current_stream().cuda_stream, src, out, 1 << 16)
                else:
                    _touch[(64,)](src, out, 1 << 16, BLOCK=1024)
    for _ in range(3):
        step()
    if variant == "relaunch_library":  # the relauncher's learned call (Triton's own launcher), its function swapped
        run, _f, packed, tail = re._learned["k"]
        swapped = _Library(src, out, "function")
        re._learned["k"] = (run, swapped.f.value, packed, tail)
        out.zero_()
        step()
        assert torch.equal(out, src), "the library-loaded function computes what Triton's does"
    torch.cuda.synchronize()
    graphs, pool = [], None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    bounds = [900 * i // parts for i in range(parts + 1)]
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


ARMS = ("plain", "triton", "relaunch", "triton_pinned", "static", "library_kernel", "library_function", "relaunch_library",
        "triton/4", "plain/4", "triton~none", "triton~foreach", "plain~foreach")


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
            result["arms"][v] = timed(build(name, int(parts or 1)))
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
