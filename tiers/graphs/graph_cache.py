"""Graph cache: a call's device work replayed as a captured CUDA graph where its tensors recur.

Owns: ``GraphCache``, a cache of graphs keyed by what a call runs (its layer, its part, the
shapes and dtypes of its inputs) and checked against the tensors it was captured with.

Why: batch-1 decode is bound by the host. transformers' batched_mm experts forward is about
ten kernels, each launched from Python, and a direct decode call adds the fetch's launch; on the
H200 machine a 12-layer Qwen3 token spent 1.7-4.1 ms more than the all-GPU model in every
offloaded arm, whatever it moved (``bench/results/bench-qwen3_moe-run29.md``). A graph replays
the same kernels with one launch from the host. The slabs never move and the direct tables
are rewritten in place (``tiers.paths.direct``), so the addresses a graph holds stay valid.

A second cache, ``Manager.prefill_graphs``, replays a whole-layer prefill
call's plan and each of its windows' kernels the same way, where a call's shapes and slots
recur (``tiers.paths.whole``).

Contract: ``run(key, bound, step, inputs)`` returns what ``step(*inputs)`` returns (a tensor or
a tuple of tensors, possibly one of its inputs as it is). ``step``
must be a function of its inputs and of the tensors listed in ``bound`` (every other tensor it
reads or writes), free of host syncs and of host-visible results. The first call with a key
runs ``step`` eagerly: it warms up kernels and
libraries. The next one captures it into a graph with static copies of the inputs, and every
later call copies its inputs there and replays. A call whose ``bound`` tensors changed since the
key's last call captures at once if that key has only warmed up so far or has replayed twice
since its tensors last changed (a step that binds another graph's outputs sees them change when
that graph is captured); otherwise it warms up again, so tensors that change on every call do
not pay a capture each. A step that cannot be captured (a host sync in it, say) runs eagerly
from then on. The returned tensors are fresh copies: the graph's own
outputs are overwritten by its next replay.

Invariant: a graph is replayed only with the very tensors it was captured with: ``bound``'s
data pointers, shapes and strides are part of the check, so a table rebuilt as a new tensor
recaptures instead of reading freed memory.

All graphs share one memory pool (they replay one after another on the compute stream, never
at once), so the pool holds about the largest step's intermediates, not their sum. On devices
without CUDA graphs the manager uses ``HostGraph``, which replays by calling the step on the
static inputs: the CPU tests run the same caching, static buffers and checks through it.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

log = logging.getLogger(__name__)


def signature(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """What a graph relies on of the tensors it reads: address, shape, strides and dtype."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def _tensors(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A step's output as a tuple of tensors (a step returns one tensor or a tuple of them)."""
    return out if isinstance(out, tuple) else (out,)


class HostGraph:
    """A graph that replays by calling its step: what a graph does, for devices without them.

    ``capture`` runs nothing (as a CUDA capture runs no kernel); ``replay`` calls the step on the
    static inputs and keeps its result in one output tensor, the same object every replay."""

    def __init__(self) -> None:
        self._step: Callable[..., torch.Tensor] | None = None
        self._inputs: tuple[torch.Tensor, ...] = ()
        self.output: torch.Tensor | None = None

    def capture(self, step: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> None:
        self._step, self._inputs = step, inputs

    def replay(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self._step(*self._inputs)
        if self.output is None:
            self.output = out
        else:
            for dst, x in zip(_tensors(self.output), _tensors(out)):
                if dst is not x:  # a step may return one of its static inputs as it is
                    dst.copy_(x)
        return self.output


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` captured on a side stream into the shared pool, replayed on
    the current stream. Capture errors stay with the capturing thread (``thread_local``), so the
    rebalancer's and readers' threads may keep using CUDA meanwhile."""

    def __init__(self, pool: Any, stream: Any) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool, self._stream = pool, stream
        self.output: torch.Tensor | None = None

    def capture(self, step: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> None:
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)  # the static inputs' copies and the warm-up precede the capture
        # no collection in the capture: a finalizer it ran could call CUDA where a capture refuses
        # it (a host pool's unregistration), and the capture would fail
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(self._stream):
                self._graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    self.output = step(*inputs)
                finally:
                    self._graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        current.wait_stream(self._stream)

    def replay(self) -> torch.Tensor:
        self._graph.replay()
        return self.output


@dataclass
class _Entry:
    bound: tuple
    graph: Any = None  # None: seen once, eagerly
    inputs: tuple[torch.Tensor, ...] = ()
    eager: bool = False  # its capture failed: eager from now on
    replays: int = 0  # replays since its bound tensors last changed
    kept: list = field(default_factory=list)  # the bound tensors themselves, alive as long as the graph


class GraphCache:
    """The graphs of one tier manager. ``enabled`` False: every call runs eagerly."""

    MAX_GRAPHS = 512  # keys kept at most (a decode's shapes are few; beyond this, the oldest go)

    def __init__(self, device: torch.device, enabled: bool, graph: Callable[[], Any] | None = None):
        self.enabled = enabled
        if graph is None and enabled:
            if device.type == "cuda":
                pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
                graph = lambda: CudaGraph(pool, stream)  # noqa: E731
            else:
                graph = HostGraph
        self._new_graph = graph
        self._entries: dict[Hashable, _Entry] = {}
        self.captured = self.replayed = self.eager_calls = self.failed = 0
        self._retired: list[Any] = []  # dropped graphs, kept until a new capture holds the pool (``_retire``)
        self.inline = False  # inside a step graph (``tiers.graphs.step_graphs``): every call runs its step, which that graph captures

    def _retire(self, entry: _Entry | None) -> None:
        """Keep a dropped entry's graph until the next capture into the shared pool succeeds: a
        pool whose last graph is freed is gone, and capturing into it again failed an internal
        assertion of torch's caching allocator (torch 2.11 on the H200: a Mixtral decode step
        recaptured with new bound tensors then ran eagerly, at several times the graph's time)."""
        if entry is not None and entry.graph is not None:
            self._retired.append(entry.graph)

    @contextlib.contextmanager
    def inlined(self):
        """Every call inside runs its step as it is: a whole decode step captured as one graph
        holds these calls' kernels itself (a capture cannot replay another graph)."""
        before, self.inline = self.inline, True
        try:
            yield
        finally:
            self.inline = before

    def run(self, key: Hashable, bound: Sequence[torch.Tensor | None], step: Callable[..., torch.Tensor],
            inputs: tuple[torch.Tensor, ...], fresh: bool = True) -> torch.Tensor:
        """See the module docstring; ``fresh`` False returns a replay's static output itself (for a
        next step that binds it, read before this key's next call)."""
        if not self.enabled or self.inline:
            return step(*inputs)
        key = (key, tuple((tuple(x.shape), x.dtype, x.device) for x in inputs))
        sig = signature(bound)
        entry = self._entries.get(key)
        if entry is not None and entry.bound != sig and not entry.eager and (entry.graph is None or entry.replays > 1):
            # warmed up with these shapes already: capture with the new tensors at once (a step
            # whose bound tensors are an earlier graph's outputs sees them change once, when that
            # graph is captured); tensors that change again before a second replay warm up again
            self._retire(entry)
            self._entries[key] = entry = _Entry(sig)
        elif entry is None or entry.bound != sig:
            if len(self._entries) >= self.MAX_GRAPHS:
                self._retire(self._entries.pop(next(iter(self._entries))))
            self._retire(entry)
            self._entries[key] = _Entry(sig)
            self.eager_calls += 1
            return step(*inputs)  # the warm-up: compiles, loads and initializes outside any capture
        if entry.eager:
            self.eager_calls += 1
            return step(*inputs)
        if entry.graph is None:
            static = tuple(x.clone() for x in inputs)
            graph = self._new_graph()
            try:
                with torch.no_grad():
                    graph.capture(step, static)
            except Exception as exc:  # a step that cannot be captured: eager from now on
                entry.eager = True
                self.failed += 1
                self.eager_calls += 1
                log.warning("tiers: decode graph for %r not captured (%s); that call runs eagerly", key[0], exc)
                return step(*inputs)
            entry.graph, entry.inputs, entry.kept = graph, static, [t for t in bound if t is not None]
            self.captured += 1
            self._retired.clear()  # the new graph holds the pool now
        else:
            for dst, x in zip(entry.inputs, inputs):
                dst.copy_(x)
        self.replayed += 1
        entry.replays += 1
        out = entry.graph.replay()
        if not fresh:
            return out
        return tuple(x.clone() for x in out) if isinstance(out, tuple) else out.clone()

    def reset_counts(self) -> None:
        self.captured = self.replayed = self.eager_calls = self.failed = 0

    def counts(self) -> dict[str, int]:
        return {"on": int(self.enabled), "graphs": sum(e.graph is not None for e in self._entries.values()),
                "captured": self.captured, "replayed": self.replayed, "eager": self.eager_calls, "failed": self.failed}
