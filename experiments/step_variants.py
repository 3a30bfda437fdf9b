"""Two changes to how a decode step graph is launched, patched in for one arm of ``decode_marks.py``.

Why: Qwen3-30B-A3B's 4-bit warm step graph took 1.8-2.2 ms of host time in ``cudaGraphLaunch``
against 0.76-0.91 ms all hot, and the device waits for it (``decode_marks-qwen3-trace.json``);
a graph holding kernels of a module Triton loads went on a slow submission path in
``graph_launch.py``. Each variant is one candidate fix, A/B'd against the same arm without it:

- ``parts``: the step graph captured as one graph per layer's experts call (a cut before each
  ``Manager.serve`` inside the capture), in one memory pool, replayed in turn: the device runs
  the first part while the host submits the next.
- ``library``: each Triton kernel the relaunchers have learned launched from its cubin loaded
  with ``cuLibraryLoadData`` (as the CUDA runtime loads its own kernels) instead of the module
  Triton loaded; the relaunchers are cleared on entry and exit, so they learn anew.

Each is a context manager; ``patched(variants)`` enters those named. Both leave the library's
results as they were (same kernels, same order); ``decode_marks`` records each arm's greedy
tokens and step-graph counts, so a failed capture or a changed answer shows.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc

import torch


@contextlib.contextmanager
def parts():
    """Step graphs captured in parts, one cut before each experts call of the step."""
    from tiers.graphs import graph_cache
    from tiers.manager import Manager

    class PartedGraph(graph_cache.CudaGraph):
        capturing: "PartedGraph | None" = None  # the graph whose capture is under way
        most = 0  # the most parts one graph was captured in

        def capture(self, step, inputs):
            self.parts = []
            PartedGraph.capturing = self
            try:
                super().capture(step, inputs)  # reads self._graph at begin and end: ``cut`` swaps it
            finally:
                PartedGraph.capturing = None
            self.parts.append(self._graph)
            PartedGraph.most = max(PartedGraph.most, len(self.parts))

        def cut(self):
            self._graph.capture_end()
            self.parts.append(self._graph)
            self._graph = torch.cuda.CUDAGraph()
            self._graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")

        def replay(self):
            for g in self.parts:
                g.replay()
            return self.output

    serve, plain = Manager.serve, graph_cache.CudaGraph

    def cutting(self, *args, **kwargs):
        if self.phase.in_step and PartedGraph.capturing is not None:
            PartedGraph.capturing.cut()
        return serve(self, *args, **kwargs)

    graph_cache.CudaGraph, Manager.serve = PartedGraph, cutting
    try:
        yield lambda: {"most_parts": PartedGraph.most}
    finally:
        graph_cache.CudaGraph, Manager.serve = plain, serve


def library_function(kernel, function: bool = True) -> int:
    """Compiled Triton ``kernel``'s cubin loaded with ``cuLibraryLoadData``: its ``CUfunction`` in
    the current context, or (``function`` False) the context-free ``CUkernel``."""
    cu = ctypes.CDLL("libcuda.so.1")

    def check(r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"{what} returned CUDA error {r}")

    lib, kern, fn = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cu.cuLibraryLoadData(ctypes.byref(lib), ctypes.c_char_p(kernel.asm["cubin"]), None, None, 0, None, None, 0),
          "cuLibraryLoadData")
    name = getattr(kernel.metadata, "name", None) or kernel.name
    check(cu.cuLibraryGetKernel(ctypes.byref(kern), lib, name.encode()), "cuLibraryGetKernel")
    if not function:
        return kern.value
    check(cu.cuKernelGetFunction(ctypes.byref(fn), kern), "cuKernelGetFunction")
    if kernel.metadata.shared > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, as Triton's loader sets it
        check(cu.cuFuncSetAttribute(fn, 8, ctypes.c_int(kernel.metadata.shared)), "cuFuncSetAttribute")
    return fn.value


def _forget() -> None:
    """Every relauncher forgets what it learned (its next calls go through Triton and learn anew)."""
    from tiers.quant.launch import Relauncher

    for obj in gc.get_objects():
        if type(obj) is Relauncher:
            obj._learned.clear()


@contextlib.contextmanager
def library():
    """Relaunchers launch library-loaded functions of their kernels' cubins."""
    from tiers.quant.launch import Relauncher

    learn, check, swapped, errors, checks = Relauncher._learn, Relauncher._check, [], [], []

    def check_keeping(self, calls, grid, args, real):  # keeps Triton's own function for ``same``
        got = check(self, calls, grid, args, real)
        if isinstance(got, tuple):
            self._learned_triton_function = got[1]
        return got

    def learn_library(self, kernel, grid, args):
        entry = learn(self, kernel, grid, args)
        if isinstance(entry, tuple):
            compiled = kernel.result() if hasattr(kernel, "result") else kernel
            try:
                entry = (entry[0], library_function(compiled), *entry[2:])
                swapped.append(getattr(compiled, "name", "?"))
                same(self, entry, grid, args, getattr(compiled, "name", "?"))
            except (RuntimeError, OSError, AttributeError, KeyError) as exc:  # Triton's own function stays
                errors.append(repr(exc))
        return entry

    def same(self, entry, grid, args, name):
        """Launch Triton's function and the library's on the same inputs (the CUDA tensors among
        ``args`` restored between): every tensor must come out bitwise equal."""
        if torch.cuda.is_current_stream_capturing():
            checks.append((name, "capturing"))
            return
        run, function, packed, tail = entry
        triton_fn = self._learned_triton_function
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
        before = [t.clone() for t in tensors]
        outs = []
        for fn in (triton_fn, function):
            for t, b in zip(tensors, before):
                t.copy_(b)
            run(grid[0], grid[1], 1, self.stream(), fn, packed, None, None, None, *args, *tail)
            torch.cuda.synchronize()
            outs.append([t.clone() for t in tensors])
        checks.append((name, "equal" if all(torch.equal(a, b) for a, b in zip(*outs)) else "DIFFERENT"))

    _forget()
    Relauncher._learn, Relauncher._check = learn_library, check_keeping
    try:
        yield lambda: {"library_functions": len(swapped), "kernels": sorted(set(swapped)), "library_errors": sorted(set(errors)),
                       "library_checks": checks}
    finally:
        Relauncher._learn, Relauncher._check = learn, check
        _forget()


@contextlib.contextmanager
def memcpy():
    """The step's length counters set as before ``step_graphs.set_lengths``: a device copy per layer."""
    from tiers.graphs import step_graphs

    def copies(cache, position):
        for layer in cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.copy_(position.reshape(length.shape))

    kept, step_graphs.set_lengths = step_graphs.set_lengths, copies
    try:
        yield dict
    finally:
        step_graphs.set_lengths = kept


VARIANTS = {"parts": parts, "library": library, "memcpy": memcpy}


@contextlib.contextmanager
def patched(names: set[str]):
    """The variants of ``names`` that this module knows, entered; yields a function returning what they report."""
    with contextlib.ExitStack() as stack:
        reports = [stack.enter_context(VARIANTS[n]()) for n in sorted(names & VARIANTS.keys())]
        yield lambda: {k: v for r in reports for k, v in r().items()}
