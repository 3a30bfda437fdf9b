"""quant.launch: a compiled Triton kernel relaunched without Triton's dispatch, only as verified.

Fake JIT functions stand in for Triton (CPU): each ``jit[grid](*args, **constexprs)`` compiles
once per specialization key and calls its kernel's launcher as a given Triton layout does. Every
call must launch exactly once, with the caller's grid, stream and arguments; the fast path must
serve only keys whose recorded launch had the verified layout.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.quant.launch import Relauncher


class FakeKernel:
    """A compiled kernel: ``run`` is a property over ``_run`` (current Triton) or a plain attribute."""

    def __init__(self, launches: list, prop: bool):
        self.function, self.packed_metadata = object(), object()
        launcher = lambda *a: launches.append(a)  # noqa: E731
        if prop:
            self._run = launcher
        else:
            self.__dict__["run"] = launcher


class PropKernel(FakeKernel):
    @property
    def run(self):
        return self._run


class Chain:
    """Triton's ``HookChain``: the launcher calls it; empty unless a hook was added."""

    def __init__(self, calls=()):
        self.calls = list(calls)


class FakeJit:
    """``layout``: "all" (the launcher gets launch metadata, empty hook chains and every argument,
    constexprs too, as Triton 3.6 does), "plain" (no metadata, None hooks, only the non-constexpr
    arguments), "shuffled" (arguments out of order), "hooked" (a hook in the chain), "callable"
    (a bare hook function), "bypass" (launches without going through ``kernel.run``)."""

    def __init__(self, layout: str, prop: bool = True):
        self.layout, self.prop = layout, prop
        self.launches: list[tuple] = []  # what reached the driver
        self.kernels: dict = {}
        self.jit_calls = 0
        self.stream = 7

    def __getitem__(self, grid):
        def call(*args, **constexprs):
            self.jit_calls += 1
            key = tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args)
            kernel = self.kernels.get(key)
            if kernel is None:
                kernel = self.kernels[key] = (PropKernel if self.prop else FakeKernel)(self.launches, self.prop)
            const = [v for k, v in constexprs.items() if k != "num_warps"]
            head = list(args)
            if self.layout == "bypass":
                self.launches.append((grid[0], grid[1], 1, self.stream, kernel.function, kernel.packed_metadata, None, None, None, *head, *const))
                return kernel
            meta, enter, leave = (None, None, None) if self.layout == "plain" else (object(), Chain(), Chain())
            if self.layout == "hooked":
                enter = Chain([print])
            elif self.layout == "callable":
                leave = print
            elif self.layout == "shuffled":
                head = head[1:] + head[:1]
            tail = [] if self.layout == "plain" else const
            kernel.run(grid[0], grid[1], 1, self.stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *head, *tail)
            return kernel
        return call


def _args(n: int = 3, offset: int = 0):
    bufs = [torch.zeros(8, dtype=torch.int64) for _ in range(n)]
    return [b[offset:] for b in bufs] + [5, 16]


def _relauncher(jit: FakeJit, hooks=lambda: False) -> Relauncher:
    return Relauncher(jit, dict(QUANT=True, BLOCK=64, num_warps=8), lambda: jit.stream, hooks)


def _check(launch: tuple, grid, args, stream, tail=()):
    assert tuple(launch[:4]) == (grid[0], grid[1], 1, stream)
    assert all(h is None or h.calls == [] for h in launch[7:9])
    got = launch[9:]
    assert len(got) == len(args) + len(tail)
    assert all(g is a for g, a in zip(got, args)), "the launcher got other arguments than the caller's"
    assert tuple(got[len(args):]) == tuple(tail)


@pytest.mark.parametrize("layout,prop", [("all", True), ("plain", True), ("all", False)])
def test_learned_layouts_are_relaunched_exactly(layout, prop):
    jit = FakeJit(layout, prop)
    r = _relauncher(jit)
    tail = (True, 64) if layout == "all" else ()
    for i in range(6):
        args = _args()
        jit.stream = 7 + i % 2  # the stream current at each call is the one launched on
        r((i + 1, 3), args, key="k")
        assert len(jit.launches) == i + 1, "a call launched other than once"
        _check(jit.launches[-1], (i + 1, 3), args, jit.stream, tail)
    assert jit.jit_calls == 2 and r.fast_launches == 4


@pytest.mark.parametrize("layout", ["shuffled", "hooked", "callable", "bypass"])
def test_unverified_layouts_keep_tritons_path(layout):
    jit = FakeJit(layout)
    r = _relauncher(jit)
    for i in range(5):
        r((2, 3), _args(), key="k")
        assert len(jit.launches) == i + 1
    assert r.fast_launches == 0 and jit.jit_calls == 5


def test_hooks_force_tritons_path_and_each_key_learns_alone():
    jit = FakeJit("all")
    on = [False]
    r = _relauncher(jit, hooks=lambda: on[0])
    for _ in range(3):
        r((1, 1), _args(), key="a")
    assert r.fast_launches == 1
    on[0] = True
    r((1, 1), _args(), key="a")
    assert r.fast_launches == 1 and jit.jit_calls == 3
    on[0] = False
    r((1, 1), _args(offset=1), key="b")  # another specialization: Triton compiles it, then learns it
    r((1, 1), _args(offset=1), key="b")
    assert r.fast_launches == 1 and jit.jit_calls == 5
    r((1, 1), _args(offset=1), key="b")
    assert r.fast_launches == 2 and len(jit.launches) == 7


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.integers(1, 4)), min_size=1, max_size=30))
def test_every_call_launches_once_with_its_own_arguments(calls):
    jit = FakeJit("all")
    hooks = [False]
    r = _relauncher(jit, hooks=lambda: hooks[0])
    for n, (key, hooked, m) in enumerate(calls):
        hooks[0] = hooked
        args = _args(offset="abc".index(key))
        r((m, 2), args, key=key)
        assert len(jit.launches) == n + 1
        _check(jit.launches[-1], (m, 2), args, jit.stream, (True, 64))


def _fake_triton(monkeypatch, knobs: bool):
    """A stand-in ``triton`` package: a driver whose current stream is 7 on device 3, and (with
    ``knobs``) a runtime whose launch hooks the test sets."""
    import sys
    import types

    driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 3,
                                                                get_current_stream=lambda device: 7 if device == 3 else None))
    pkg = types.ModuleType("triton")
    runtime_mod = types.ModuleType("triton.runtime")
    runtime_mod.driver = driver
    pkg.runtime = runtime_mod
    rt = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setitem(sys.modules, "triton", pkg)
    monkeypatch.setitem(sys.modules, "triton.runtime", runtime_mod)
    if knobs:
        knobs_mod = types.ModuleType("triton.knobs")
        knobs_mod.runtime = rt
        pkg.knobs = knobs_mod
        monkeypatch.setitem(sys.modules, "triton.knobs", knobs_mod)
    else:
        monkeypatch.delitem(sys.modules, "triton.knobs", raising=False)  # not a package: the import fails
    return rt


def test_triton_relauncher_reads_tritons_stream_and_hooks(monkeypatch):
    from tiers.quant.launch import triton_relauncher

    rt = _fake_triton(monkeypatch, knobs=True)
    jit = FakeJit("all")
    r = triton_relauncher(jit, {"BLOCK": 64})
    assert r.stream() == 7 and r.hooks() is False
    rt.launch_enter_hook = Chain([print])  # a profiler's hook: Triton's own path
    assert r.hooks() is True
    rt.launch_enter_hook, rt.launch_exit_hook = Chain(), print
    assert r.hooks() is True
    rt.launch_exit_hook = None
    assert r.hooks() is False
    jit.stream = 7
    for _ in range(3):
        args = _args()
        r((2, 1), args, key="k")
    assert r.fast_launches == 1
    _check(jit.launches[-1], (2, 1), args, 7, (64,))


def test_triton_relauncher_without_knobs_keeps_tritons_path(monkeypatch):
    from tiers.quant.launch import triton_relauncher

    _fake_triton(monkeypatch, knobs=False)
    r = triton_relauncher(FakeJit("all"), {})
    assert r.hooks() is True


def test_kernel_module_needs_cuda_and_an_importable_module(monkeypatch):
    import tiers.quant.core
    from tiers.quant.launch import kernel_module

    kernel_module.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_module("core") is None
    kernel_module.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel_module("core") is tiers.quant.core
    assert kernel_module("no_such_kernel") is None  # as where Triton is missing: the import fails
    kernel_module.cache_clear()
