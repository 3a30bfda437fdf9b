"""Skewed, sticky routing for timed runs: every experts module of a model routes by a synthetic trace.

Owns: ``TraceRouting``, forward pre-hooks on a model's experts modules that replace the router's
``top_k_index`` with rows of a trace drawn from ``tiers.trace.TraceModel`` (per-layer Zipf
popularity, sticky reuse between consecutive tokens). Random-weight routers route almost
uniformly; with this every arm of a benchmark (the all-GPU model, a lazy ``.to()`` implementation,
accelerate's ``dispatch_model``, Tiers) sees the same skewed sequence of picks. The hooks sit in
``nn.Module.__call__``'s pre-hook list, so they run whatever experts implementation is selected and
also when accelerate has replaced the module's ``forward`` with its wrapper.

Invariant: a hook never reads a device tensor on the host and never syncs, and keeps no host state
that changes between calls, so a CUDA graph that captured it routes each replay by the next rows
(the hooks are marked ``tiers.step_graph.graph_safe``: Tiers' step graphs run with them set). The
trace is sampled once and placed on one device with one counter per layer beside it; a call takes
its rows by a gather at the counter (modulo the trace's length: it wraps around) and adds its
token count to the counter in place: four small kernels per layer call, the same in every arm.
``top_k_weights`` is passed on untouched, and after ``remove()`` the model routes exactly as before.
"""
from __future__ import annotations

import functools
import weakref

import torch

from tiers.loader.layout import find_experts_modules
from tiers.graphs.step_graphs import graph_safe
from tiers.tools.trace import TraceModel

# experts module -> the TraceRouting that routes it: two live routings on one module would stack.
_ROUTED: weakref.WeakKeyDictionary[torch.nn.Module, TraceRouting] = weakref.WeakKeyDictionary()


class TraceRouting:
    """Route every experts module of ``model`` by a pre-sampled ``TraceModel`` trace.

    Installs the hooks on construction; ``remove()`` (or leaving a ``with`` block) takes them off.

    - ``zipf_s``, ``reuse_p``, ``seed``: the ``TraceModel`` (``zipf_s=0, reuse_p=0`` is uniform); the
      defaults are the skewed trace the bench scripts route by.
    - ``tokens``: trace length sampled up front (4096 covers a 2048-token prefill plus decode);
      a layer that runs past the end wraps around to row 0.
    - ``top_k``: picks per token; default ``config.num_experts_per_tok``. Every call must match it.
    - ``device``: where the trace and the counters live; default the device of the model's first
      parameter not on the meta device. A call whose ``top_k_index`` lives elsewhere gets its rows
      copied there (a sync when that is the host and the trace is on a GPU).

    Each call of a layer's experts module with ``T`` tokens gets that layer's next ``T`` rows, in
    the flattened token order the MoE block sees (batch-major). Layers count separately, so every
    layer sees the same token sequence. ``reset()`` rewinds every layer to row 0.
    """

    def __init__(self, model: torch.nn.Module, *, zipf_s: float = 1.2, reuse_p: float = 0.5, seed: int = 0,
                 tokens: int = 4096, top_k: int | None = None, device: torch.device | str | None = None):
        mods = find_experts_modules(model)
        if not mods:
            raise ValueError(f"{type(model).__name__} has no experts module (none wrapped by transformers' use_experts_implementation)")
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        n_experts = {int(m.num_experts) for _, m in mods.values()}
        if len(n_experts) != 1:
            raise ValueError(f"experts modules disagree on num_experts ({sorted(n_experts)}); one TraceModel needs one count")
        if top_k is None:
            config = getattr(model, "config", None)
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            top_k = getattr(config, "num_experts_per_tok", None)
            if top_k is None:
                raise ValueError("the model config has no num_experts_per_tok: pass top_k=")
        for name, m in mods.values():
            if m in _ROUTED:
                raise ValueError(f"{name} is already routed by a TraceRouting: remove() that one first")
        self.layers: list[int] = list(mods)
        self.trace_model = TraceModel(len(mods), n_experts.pop(), int(top_k), zipf_s, reuse_p, seed)
        self.tokens = tokens
        cpu = self.trace_model.sample(tokens).transpose(0, 1).contiguous()  # [L, N, k]: one layer's rows contiguous
        if device is None:
            device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # the key a tensor's .device will have
        self._cpu = cpu
        self._rows = cpu.to(device)  # [L, N, k] on the counters' device
        self._next = torch.zeros(len(mods), dtype=torch.long, device=device)  # per layer column: rows handed out so far
        self._offsets = torch.arange(tokens, device=device)  # a call of T <= N tokens takes rows next + [0, T)
        self._handles = []
        for column, (name, m) in enumerate(mods.values()):
            hook = graph_safe(functools.partial(self._pre_hook, column))
            # prepend: other pre-hooks (and accelerate's wrapper, which runs inside forward) see the trace
            self._handles.append(m.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
            _ROUTED[m] = self
        self._routed = [m for _, m in mods.values()]

    # -- the trace -------------------------------------------------------------------------
    @property
    def trace(self) -> torch.Tensor:
        """[tokens, layers, top_k] the pre-sampled picks (a CPU view; column i is ``self.layers[i]``)."""
        return self._cpu.transpose(0, 1)

    def popularity(self) -> torch.Tensor:
        """[layers, experts] the Zipf prior the picks are drawn from."""
        return self.trace_model.popularity()

    @property
    def positions(self) -> dict[int, int]:
        """layer -> the next trace row that layer hands out (reads the counters: a sync on a GPU)."""
        return dict(zip(self.layers, (self._next % self.tokens).tolist()))

    def reset(self) -> None:
        """Rewind every layer to row 0, so the next run sees the same picks as the first."""
        self._next.zero_()

    # -- hooks -----------------------------------------------------------------------------
    def _rows_no_sync(self, column: int, index: torch.Tensor) -> torch.Tensor:
        """The next ``T`` rows of one layer, on ``index``'s device, by kernels alone: offsets from
        the layer's counter modulo the trace length, a gather, and the counter moved on."""
        if index.dim() != 2 or index.shape[1] != self.trace_model.top_k:
            raise ValueError(f"top_k_index of layer {self.layers[column]} has shape {tuple(index.shape)}; "
                             f"this TraceRouting hands out [tokens, {self.trace_model.top_k}] (pass top_k=)")
        want = index.shape[0]
        offsets = self._offsets[:want] if want <= self.tokens else torch.arange(want, device=self._next.device)
        counter = self._next[column]  # a 0-d view: the add below moves this layer's counter on
        at = torch.add(offsets, counter).remainder_(self.tokens)  # [T] the trace rows, wrapping at the end
        out = self._rows[column].index_select(0, at)  # [T, k]
        counter.add_(want)
        if out.device != index.device:
            out = out.to(index.device)
        return out if out.dtype == index.dtype else out.to(index.dtype)

    def _pre_hook(self, column: int, module: torch.nn.Module, args: tuple, kwargs: dict):
        # transformers 5.x calls self.experts(hidden_states, top_k_index, top_k_weights) positionally;
        # keyword calls are handled the same way.
        if "top_k_index" in kwargs:
            return args, {**kwargs, "top_k_index": self._rows_no_sync(column, kwargs["top_k_index"])}
        if len(args) < 2:
            raise TypeError(f"experts module of layer {self.layers[column]} was called without top_k_index")
        return (args[0], self._rows_no_sync(column, args[1]), *args[2:]), kwargs

    # -- lifecycle -------------------------------------------------------------------------
    def remove(self) -> None:
        """Take the hooks off: the model routes by its own router again. Safe to call twice."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self._routed:
            if _ROUTED.get(m) is self:
                del _ROUTED[m]
        self._routed = []

    def __enter__(self) -> TraceRouting:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
