"""A CPU stand-in for a CUDA graph that replays only the recorded tensor ops, as a CUDA graph does.

``tiers.graphs.HostGraph`` replays by calling its step again: host code inside the step (a Python
counter in a hook, a branch on a value read once) runs at every replay, so a test through it
cannot see what a CUDA graph would freeze. ``ReplayGraph`` records every ATen op the step runs at
the capture (``TorchDispatchMode``) and each replay runs those ops again on the very tensors they
ran on, writing each op's result into the tensor the capture produced (a graph's fixed
addresses). Whatever the step decided on the host at the capture is replayed as it was decided.

Capture: a CUDA capture runs no kernel and ``DecodeGraphs`` replays right after it, so the first
replay here returns what the capture computed instead of running the ops a second time: every
``run`` executes the step's work exactly once, as on the GPU.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class ReplayGraph:
    """A graph for ``tiers.graphs.graph_cache.GraphCache`` / ``tiers.graphs.step_graphs.install`` (``graph=ReplayGraph``)."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.output: Any = None
        self._fresh = False  # the capture's results stand for the first replay

    def capture(self, step: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad(), _Recorder(self.ops):
            self.output = step(*inputs)
        self._fresh = True

    def replay(self) -> Any:
        if self._fresh:
            self._fresh = False
            return self.output
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                res = func(*args, **kwargs)
                for dst, got in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                    if isinstance(dst, torch.Tensor) and dst is not got and not _same_memory(dst, got):
                        dst.copy_(got)
        return self.output
