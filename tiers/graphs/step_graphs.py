"""Step graphs: a whole one-token decode step of ``generate`` replayed as one CUDA graph.

Owns: ``StepGraphs``, which stands in for the loaded model's ``forward``. In generate's decode
stage, at batch 1, it runs each step on a static KV cache of its own, captured once as one graph
(embeddings, attention, routers, every layer's experts call, the head) and replayed; every other
call goes to the model's own forward. It keeps the cache generate holds complete.

Why: batch-1 decode at these sizes is bound by the host launching kernels one by one from
Python, not by the device. On the H200, untiered and all on the GPU, a 12-layer Qwen3-30B-A3B
decode step took 19-22 ms op by op and 3.0 ms replayed as one graph; an 8-layer Mixtral-8x7B one
8.7-12.6 ms and 3.8 ms (``experiments/step_graph_probe.py``, ``experiments/results/step_graph_probe.json``).
Tiers' per-layer decode graphs (``tiers.graphs.graph_cache``) replay only the experts calls.

How a step runs:

- The prefill runs as transformers runs it, with generate's dynamic cache: a static cache's
  prefill attends over the whole padded length (a 2048-token Qwen3 prefill took 28.7 ms against
  25.4 in the same probe).
- At a decode step that qualifies, the positions generate's cache holds beyond the static
  cache's are copied in, the manager does every layer's host work for the token
  (``Manager.begin_step``: the rebalancer's token, the calls' counts), and the graph runs
  with the token and its position copied into its static inputs. Inside it the experts calls do
  only device work: all-hot layers' batched forward, direct calls' fetch and forward
  (``tiers.paths.direct``), their own decode graphs run inline.
- Before a step runs op by op (a layer fell off direct decode, say) and when the decode stage
  ends, generate's cache gets the positions the graph wrote; what ``generate`` returns with
  ``return_dict_in_generate`` holds every position.
- The static cache holds a power of two of positions, at least 1024; a longer sequence moves to
  one twice as large (copied), with a graph of its own. It is kept across generates, so the
  graph is captured once per size, not per call.

A step qualifies when: the manager says it is generate's decode stage; one sequence, one token;
the call passes only what generate passes (ids, positions, cache, mask, flags; without
positions, the token goes at the cache's end, as the model would put it); generate's cache is a
dynamic cache of full-attention layers, keys and values of one head size (not DeepSeek's MLA),
or of full and sliding-window layers under eager attention (GPT-OSS: the static cache holds
every position of a sliding layer too, and the step's own masks hide those outside the window); the attention mask, if any, is all ones (read once per decode stage: one sync); and every
MoE layer runs static or direct this step; and every forward hook set on the model's modules (or
on all modules) is marked ``graph_safe`` (a graph replays what a hook did at the capture: only
its kernels). Otherwise the step runs op by op, counted by reason in ``report()``. A graph
holds the kernels of the marked hooks set when it was captured: when the hooks a step runs are
not those, the graphs are dropped (with their pool, and what they kept of the old hooks) and
the step captures anew.

Invariants: the static cache's first ``static_len`` positions are the sequence's (those of
generate's cache, and those the graph wrote after them); generate's cache is complete whenever
anything but a graph step reads it; a graph is replayed only with the tensors it captured
(``tiers.graphs.graph_cache``: the static cache and the slot caches of the stage are its bound tensors).
"""
from __future__ import annotations

import functools
import inspect
from collections import Counter
from typing import Any, Callable

import torch

from tiers.graphs.graph_cache import GraphCache

# what generate passes a decode step (transformers 5.x spells the cache either way)
_PASSED = {"input_ids", "attention_mask", "position_ids", "past_key_values", "cache", "cache_position", "use_cache",
           "return_dict", "logits_to_keep", "output_attentions", "output_hidden_states"}


class StepGraphs:
    """The model's forward, with generate's batch-1 decode steps replayed as one graph (see the
    module docstring). ``enabled`` False: every call goes to the model's forward."""

    MIN_POSITIONS = 1024

    def __init__(self, model: torch.nn.Module, manager: Any, enabled: bool, graph: Callable[[], Any] | None = None):
        self.model, self.mgr = model, manager
        self.forward = model.forward
        self.modules = list(model.modules())  # whose hooks ``_why_not`` looks for
        params = inspect.signature(self.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pass_position = "cache_position" in params
        self.keep_logits = "logits_to_keep" in params
        text = model.config.get_text_config(decoder=True)
        self.text_config = text
        # Eager attention builds its float mask with a host-to-device copy (transformers' eager_mask),
        # which a capture refuses: the step passes the mask by layer type instead (``_eager_masks``).
        self.eager_attention = getattr(model.config, "_attn_implementation", None) == "eager" and bool(getattr(text, "layer_types", None))
        # sliding-window layers: served only where the step makes the masks (it hides what the window does not see)
        types = set(getattr(text, "layer_types", None) or ())
        self.window = text.sliding_window if "sliding_attention" in types and self.eager_attention else None
        self.layer_kinds_ok = types <= {"full_attention", "sliding_attention"} and ("sliding_attention" not in types or self.window)
        self.top_k = getattr(text, "num_experts_per_tok", None)
        self.enabled = enabled and self.top_k is not None
        self._graph = graph
        self.graphs = GraphCache(manager.device, self.enabled, graph=graph)  # one per cache size and hooks (``_renew``)
        self._retired = Counter()  # the counts of the graphs left behind
        self.cache: Any = None  # the static cache (transformers' StaticCache), kept across generates
        self.kv: list[torch.Tensor] = []  # its keys and values, layer by layer: what a step graph binds of it
        self.capacity = 0
        self.static_len = 0  # positions of the current sequence the static cache holds
        self.dyn: Any = None  # generate's cache in this decode stage
        self.mask_ok: bool | None = None  # the stage's attention mask was all ones (None: not read yet)
        self.output_type: type | None = None  # the model's output class, from its last own forward
        self.hooks: tuple = ()  # the graph-safe hooks the current step runs (``_safe_hooks``)
        self.graph_hooks: tuple = ()  # the hooks ``self.graphs`` were captured with
        self.steps = 0
        self.eager: Counter = Counter()

    # -- the forward ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if not (self.enabled and self.mgr.phase.decoding):
            return self._own(*args, **kwargs)
        why = self._why_not(args, kwargs)
        if why is None:
            out = self._step(kwargs)
            if out is not None:
                return out
            why = "layers"
        self.eager[why] += 1
        self._give_back()
        return self._own(*args, **kwargs)

    def _own(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        self.output_type = type(out)
        return out

    def _why_not(self, args: tuple, kwargs: dict) -> str | None:
        """Why this call cannot run as a graph step (None: it can); no side effect but the
        stage's one mask read and noting the step's hooks (``self.hooks``)."""
        if args or not set(kwargs) <= _PASSED:
            return "arguments"
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape != (1, 1):
            return "shape"
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("use_cache") is False \
                or kwargs.get("return_dict") is False:
            return "arguments"
        if self.output_type is None:
            return "arguments"
        hooks = _safe_hooks(self.modules)
        if hooks is None:
            return "hooks"
        self.hooks = hooks
        dyn = kwargs.get(self.cache_kw)
        if not (self.layer_kinds_ok and _plain_dynamic(dyn, sliding=self.window is not None)):
            return "cache"
        if self.dyn is not None and dyn is not self.dyn:
            return "cache"  # another cache within one stage: left to the model
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if self.mask_ok is None:
                self.mask_ok = bool(mask.all())  # once per stage: later steps only append ones
            if not self.mask_ok:
                return "padding"
        return None

    def _step(self, kwargs: dict) -> Any:
        """Run one decode step as the graph; None (nothing changed but the token's host work,
        which the manager keeps) when a layer cannot run inside it."""
        dyn = kwargs[self.cache_kw]
        if self.dyn is None:
            self.dyn, self.static_len = dyn, 0
        have = dyn.get_seq_length()
        pos = max(have, self.static_len)
        self._fit(pos + 1, dyn)
        if have > self.static_len:
            self._copy_in(dyn, self.static_len, have)
            self.static_len = have
        if not self.mgr.begin_step(self.top_k):
            return None
        position = kwargs.get("cache_position")
        if position is None:
            position = kwargs.get("position_ids")
        if position is None:  # as the model would: the cache's length (the static cache's, ahead of generate's)
            position = torch.full((1,), pos, dtype=torch.int64, device=kwargs["input_ids"].device)
        position = position.reshape(1)
        bound = self.kv + self.mgr.step_bound()
        if self.hooks != self.graph_hooks:  # a graph holds its hooks' kernels: other hooks, other graphs
            self._renew()
            self.graph_hooks = self.hooks
        logits = self.graphs.run(("step", self.capacity), bound, self._replayed, (kwargs["input_ids"], position))
        self.static_len = pos + 1
        self.steps += 1
        return self.output_type(logits=logits, **{self.cache_kw: dyn})

    def _replayed(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The step a graph captures: the model's forward on the static cache, its experts calls
        doing only their device work."""
        mgr = self.mgr
        mgr.phase.in_step = True
        try:
            with mgr.decode_graphs.inlined(), torch.no_grad():
                set_lengths(self.cache, position)
                kw = {self.cache_kw: self.cache, "position_ids": position.view(1, 1), "use_cache": True, "return_dict": True}
                if self.pass_position:
                    kw["cache_position"] = position
                if self.keep_logits:
                    kw["logits_to_keep"] = 1
                if self.eager_attention:
                    kw["attention_mask"] = self._eager_masks(position)
                return self.forward(input_ids=ids, **kw).logits
        finally:
            mgr.phase.in_step = False

    def _eager_masks(self, position: torch.Tensor) -> dict[str, torch.Tensor]:
        """Eager attention's mask of one token at ``position`` over the static cache, by layer type:
        0 where a key position is at most ``position`` (and, in a sliding layer, more than
        ``position - window``), the dtype's minimum elsewhere; what transformers' eager_mask gives,
        made on the device. A sliding layer's static cache holds every position; those the window
        leaves out (stale, or never copied in) get the minimum, so they weigh exactly 0."""
        dtype = self.kv[0].dtype
        keys = torch.arange(self.capacity, device=position.device)  # [capacity]
        hidden = {"full_attention": keys > position}
        if "sliding_attention" in self.text_config.layer_types:
            hidden["sliding_attention"] = (keys > position) | (keys <= position - self.window)
        low = torch.finfo(dtype).min
        return {t: torch.zeros(1, 1, 1, self.capacity, dtype=dtype, device=position.device).masked_fill_(hidden[t], low)
                for t in set(self.text_config.layer_types)}

    # -- the two caches -----------------------------------------------------------------------
    def _fit(self, positions: int, dyn: Any) -> None:
        """A static cache of at least ``positions`` positions, shaped as ``dyn``'s layers: the one
        held, or one twice as large with what it held copied over (its old graph dropped with its pool)."""
        if self.cache is not None and positions <= self.capacity:
            return
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        size = max(self.MIN_POSITIONS, self.capacity)
        while size < positions:
            size *= 2
        first = dyn.layers[0].keys
        with torch.inference_mode(False), torch.no_grad():  # kept across calls, some outside inference mode
            cache = StaticCache(config=self.text_config, max_cache_len=size)
            # a sliding layer gets a full one: the step's masks do the window (``_eager_masks``)
            cache.layers = [StaticLayer(max_cache_len=size) if getattr(layer, "is_sliding", False) else layer
                            for layer in cache.layers]
            cache.early_initialization(batch_size=1, num_heads=first.shape[1], head_dim=first.shape[-1], dtype=first.dtype,
                                       device=first.device)
            if self.cache is not None and self.static_len:
                for new, old in zip(cache.layers, self.cache.layers):
                    new.keys[:, :, : self.static_len].copy_(old.keys[:, :, : self.static_len])
                    new.values[:, :, : self.static_len].copy_(old.values[:, :, : self.static_len])
        if self.cache is not None:
            self._renew()
        self.cache, self.capacity = cache, size
        self.kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]

    def _renew(self) -> None:
        """Drop the graphs (a new cache size, other hooks): new ones get a new pool, the old
        graphs go with their own (a CUDA graph pool whose graphs are all gone cannot take a capture)."""
        self._retired.update(self.graphs.counts())
        self.graphs = GraphCache(self.mgr.device, self.graphs.enabled, graph=self._graph)

    def _copy_in(self, dyn: Any, start: int, end: int) -> None:
        """Positions [start, end) of generate's cache into the static one; a sliding layer holds
        only its last positions (``first`` on), and gives those of [start, end) it has."""
        for s, d in zip(self.cache.layers, dyn.layers):
            first = d.get_seq_length() - d.keys.shape[-2]  # the sequence position of d.keys[:, :, 0]
            lo = max(start, first)
            if lo < end:
                s.keys[:, :, lo:end].copy_(d.keys[:, :, lo - first:end - first])
                s.values[:, :, lo:end].copy_(d.values[:, :, lo - first:end - first])

    def _give_back(self) -> None:
        """Generate's cache gets the positions only the static cache holds (the graph wrote them),
        before anything else reads it."""
        dyn = self.dyn
        if dyn is None:
            return
        have = dyn.get_seq_length()
        if self.static_len > have:
            for i, s in enumerate(self.cache.layers):
                dyn.update(s.keys[:, :, have:self.static_len].clone(), s.values[:, :, have:self.static_len].clone(), i)

    def begin_stage(self) -> None:
        """A decode stage begins: its sequence starts from generate's cache alone."""
        self.dyn, self.static_len, self.mask_ok = None, 0, None

    def end_stage(self) -> None:
        """The decode stage ended: generate's cache gets every position (what generate returns)."""
        self._give_back()
        self.dyn, self.static_len, self.mask_ok = None, 0, None

    # -- stats --------------------------------------------------------------------------------
    def report(self) -> dict:
        g = self._retired + Counter(self.graphs.counts())
        cache = sum(t.numel() * t.element_size() for t in self.kv)
        return {"on": int(self.enabled), "steps": self.steps, "captured": g["captured"], "failed": g["failed"],
                "eager": dict(self.eager), "cache_bytes": cache, "positions": self.capacity}

    def reset_counts(self) -> None:
        self.steps = 0
        self.eager.clear()
        self.graphs.reset_counts()
        self._retired.clear()


GRAPH_SAFE = "__tiers_graph_safe__"


def set_lengths(cache: Any, position: torch.Tensor) -> None:
    """Each layer's length counter (a cache that counts its own, newer transformers) set to
    ``position``, by a device copy per layer. Whether one kernel for them all decodes faster is
    what ``experiments/decode_marks.py``'s ``~foreach`` and ``~shared`` arms measure."""
    for layer in counted_layers(cache):
        layer.cumulative_length.copy_(position.reshape(layer.cumulative_length.shape))


def counted_layers(cache: Any) -> list:
    """The cache's layers whose length counter is a tensor (those ``set_lengths`` sets)."""
    return [layer for layer in cache.layers if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]


def graph_safe(hook: Callable) -> Callable:
    """Mark a forward hook (or pre-hook) as one a step graph may hold, and return it.

    A step graph runs the hook once, at its capture, and then replays only the kernels it
    launched. So a marked hook must keep all its state that changes from call to call in device
    tensors and update it with kernels (a counter it adds to in place, say), never read a device
    tensor on the host, and keep every tensor it reads or writes alive at one address while it is
    set (``tools.routing.TraceRouting`` is one). An unmarked hook keeps steps op by op.
    ``hook``: a function or ``functools.partial`` (a bound method takes no attribute: wrap it)."""
    try:
        setattr(hook, GRAPH_SAFE, True)
    except AttributeError:
        raise TypeError(f"graph_safe: cannot mark {hook!r}; pass a function or a functools.partial") from None
    return hook


def _safe_hooks(modules: list[torch.nn.Module]) -> tuple | None:
    """The forward hooks a step would run (global ones and those on ``modules``), in order, when
    all are marked ``graph_safe``; None when any is not. A hook runs on the host at each call,
    and a graph replays what it did at the capture: a routing hook that hands out each call's
    picks from a host-side counter would route every replayed step as the captured one."""
    nn = torch.nn.modules.module
    found: list = []
    for hooks in (nn._global_forward_pre_hooks, nn._global_forward_hooks,
                  *(h for m in modules for h in (m._forward_pre_hooks, m._forward_hooks) if h)):
        for hook in hooks.values():
            if not getattr(hook, GRAPH_SAFE, False):
                return None
            found.append(hook)
    return tuple(found)


def _plain_dynamic(cache: Any, sliding: bool = False) -> bool:
    """A transformers DynamicCache whose layers are all full-attention ones (or, with ``sliding``,
    full and sliding-window ones), each already filled."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    kinds = (DynamicLayer, DynamicSlidingWindowLayer) if sliding else (DynamicLayer,)
    return (type(cache) is DynamicCache and bool(cache.layers)
            and all(type(layer) in kinds and getattr(layer, "keys", None) is not None and layer.keys.numel()
                    and layer.keys.shape == layer.values.shape  # keys and values of one head size (not MLA's)
                    for layer in cache.layers))


def install(model: torch.nn.Module, manager: Any, graph: Callable[[], Any] | None = None) -> StepGraphs:
    """Put a ``StepGraphs`` in place of ``model.forward`` (generate reads the forward's signature,
    which the wrapper keeps) and give it to ``manager`` (``manager.steps``: its stage and stats).
    ``graph``: what a graph is (default: a CUDA graph on CUDA, ``tiers.graphs.graph_cache.HostGraph`` elsewhere)."""
    steps = StepGraphs(model, manager, True, graph=graph)
    manager.steps = steps

    @functools.wraps(steps.forward)
    def forward(*args, **kwargs):
        return steps(*args, **kwargs)

    model.forward = forward
    return steps
