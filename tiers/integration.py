"""The transformers integration: ``tiers.load`` and the two tiers experts implementations.

Owns: building the model on meta from ``config.json``, loading the dense weights, binding each
experts module to the tier manager, and the experts forwards registered in transformers'
``ALL_EXPERTS_FUNCTIONS`` (selected with ``set_experts_implementation``; no model class is
patched):

- "tiers" (``compute: eager``) follows transformers' eager experts loop operation for operation
  with each expert's weights read from its GPU slot: all-bf16 logits are bit-identical to the
  untiered model running the eager implementation;
- "tiers_grouped" (``compute: grouped``, the default): a layer whose experts are all hot runs
  transformers' own grouped_mm forward (batched_mm in generate's decode stage on a GPU, as
  transformers switches for an untiered model) on views of its slots; in that decode stage any
  other layer runs the same batched_mm with each pick's slot as its expert id; otherwise it sorts
  its (token, pick) rows by slot and runs grouped GEMMs over windows of the slab around the used
  slots, summed per token as transformers sums them. Bit-identical to untiered grouped_mm when
  a layer call's experts fit the staging slots; when they do not, parts over their own rows
  summed in fp32 (bit-identical per layer on the CPU, within one bf16 ulp on CUDA).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig, PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward, grouped_mm_experts_forward

try:  # the grouped linear transformers' grouped_mm forward runs (kernel choice, CPU alignment fallback)
    from transformers.integrations.moe import _grouped_linear
except ImportError:  # a transformers without it: the same operation on torch's grouped_mm
    def _grouped_linear(input, weight, offs, bias=None, is_transposed=False):
        out = torch._grouped_mm(input.to(weight.dtype), weight if is_transposed else weight.transpose(-2, -1), offs=offs)
        return out + bias if bias is not None else out

from tiers.loader.layout import ExpertKey, discover_layout, find_experts_modules
from tiers.loader.packed import Manifest, file_crc32, read_manifest
from tiers.loader.routing import read_routing, routing_document, write_routing
from tiers.loader.skeleton import build_skeleton
from tiers.config import TiersConfig, load_config
from tiers.disk_store import IntegrityError
from tiers import host_compute, step_graph
from tiers.engine import Streams, TierManager
from tiers.policy import plan_placement
from tiers.stats import TierStats

IMPLEMENTATION = "tiers"  # eager: the per-expert loop, bit-identical to transformers' eager experts
GROUPED = "tiers_grouped"  # grouped_mm over the slots, as transformers' default grouped_mm experts
_MANAGER_ATTR = "_tiers_manager"


@dataclass(frozen=True)
class LayerBinding:
    """What an experts module needs: its layer index, the manager, and the routers of the next
    ``prefetch_depth`` MoE layers (layer index, router weight [E, H]) for speculative routing."""

    layer: int
    manager: TierManager
    lookahead: tuple[tuple[int, torch.Tensor], ...] = ()


WHOLE_LAYER = 0.9  # predicted share of a layer's experts above which its unnamed ones are predicted too (after the named)


def _route(self: torch.nn.Module, binding: LayerBinding, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> tuple[list[int], list[int], list[int] | None]:
    """The experts this call uses (ascending), the number of (token, pick) rows routed to each
    expert id (sentinel included), and, for a call of at most ``HOST_ROUTED_ROWS`` rows (decode),
    the picks themselves in row order (else None). One sync brings these back together with the
    predicted experts of the next layers, which are recorded and staged ahead into free slots."""
    n = self.num_experts
    flat = top_k_index.reshape(-1)
    rows_n = flat.numel()
    host_picks = rows_n <= TierManager.HOST_ROUTED_ROWS
    d = len(binding.lookahead)
    flags = torch.zeros(d + (not host_picks), n + 1, dtype=torch.int32, device=top_k_index.device)  # [(1+)d, E+1]
    if not host_picks:
        flags[0].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # rows per expert
    ahead = flags[(not host_picks):]
    k = top_k_index.shape[-1]
    for i, (_, weight) in enumerate(binding.lookahead):
        logits = hidden_states.to(weight.dtype) @ weight.t()  # [T, E'] the next layer's router on this layer's input
        picked = torch.topk(logits, min(k, weight.shape[0]), dim=-1).indices.reshape(-1)  # [T*k']
        ahead[i, : weight.shape[0]].index_add_(0, picked, torch.ones_like(picked, dtype=torch.int32))  # votes per expert
    # One device-to-host sync: the dynamic schedule needs the routed experts on the host to stage misses.
    if host_picks:
        values = torch.cat([flat.to(torch.int32), flags.reshape(-1)]).tolist() if d else flat.tolist()
        picks = values[:rows_n]
        counts = _rows_per_expert(picks, n)
        rows = [values[rows_n + i * (n + 1) : rows_n + (i + 1) * (n + 1)] for i in range(d)]
        if counts[n]:  # sentinel picks (expert parallelism): leave them to the device-side path
            picks = None
    else:
        table = flags.tolist()
        counts, rows, picks = table[0], table[1:], None
    hit = [e for e in range(n) if counts[e]]
    mgr = binding.manager
    mgr.note_used(binding.layer, hit)
    for (layer, weight), row in zip(binding.lookahead, rows):
        votes = row[: weight.shape[0]]
        # most votes first: a long call's tokens name most of the next layer's experts, and the
        # read-ahead's slots take only the first few
        predicted = sorted((e for e, v in enumerate(votes) if v), key=lambda e: -votes[e])
        if len(predicted) >= WHOLE_LAYER * weight.shape[0]:
            predicted += [e for e, v in enumerate(votes) if not v]
        mgr.note_prediction(layer, predicted)
    return hit, counts, picks


def _rows_per_expert(picks: list[int], n: int) -> list[int]:
    """The (token, pick) rows routed to each expert id of ``n`` (and the sentinel, id ``n``)."""
    counts = [0] * (n + 1)
    for e in picks:
        counts[e] += 1
    return counts


def _prefetch(binding: LayerBinding, limit: int | None = None, direct: bool = True) -> None:
    """Stage what was predicted for the next layers (at most ``limit`` experts each); called while
    this layer's experts are held, or after a streamed call gave its slots back (then through
    the copy engine, ``direct=False``, as the call's own reads)."""
    mgr = binding.manager
    for layer, _ in binding.lookahead:
        predicted = mgr.predicted.get(layer)
        if predicted and layer not in mgr.static_maps:
            mgr.prefetch(layer, predicted, limit, direct)


def tiers_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    binding = _binding(self)
    binding.manager.settle()  # this call counts after the whole-layer calls before it
    final_hidden_states = torch.zeros_like(hidden_states)  # [T, H]
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)  # [T, k, E+1]
        expert_mask = expert_mask.permute(2, 1, 0)  # [E+1, k, T]
        hit, _, _ = _route(self, binding, hidden_states, top_k_index)
    binding.manager.begin_call(binding.layer, hit, hidden_states.shape[0])
    up_name = "gate_up_proj" if self.has_gate else "up_proj"
    prefetched = not binding.lookahead
    for expert_idx, w in binding.manager.serve_layer(binding.layer, hit):
        if not prefetched:  # the first expert is held and its copies queued: stage the next layers behind them
            _prefetch(binding)
            prefetched = True
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])  # [n], [n]
        current_state = hidden_states[token_idx]  # [n, H]
        h = _project(current_state, w[up_name], w.get(up_name + "_bias"), self.is_transposed)  # [n, 2I] or [n, I]
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)  # [n, I]
        h = _project(h, w["down_proj"], w.get("down_proj_bias"), self.is_transposed)  # [n, H]
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        h = h * top_k_weights[token_idx, top_k_pos, None]  # [n, H]
        final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
    return final_hidden_states


def _binding(module: torch.nn.Module) -> LayerBinding:
    binding = getattr(module, "_tiers_binding", None)
    if binding is None:
        raise RuntimeError(f"{type(module).__name__} has no tier binding: the tiers experts implementations serve models loaded with tiers.load")
    return binding


class _SlotExperts:
    """The experts module seen through the slots: ``<tensor>[slot]`` is the expert in that slot.

    transformers' grouped_mm forward runs on it unchanged, with expert ids mapped to slot ids.
    """

    def __init__(self, module: torch.nn.Module, slabs: dict[str, torch.Tensor], n_slots: int):
        for name in ("has_gate", "has_bias", "is_transposed", "is_concatenated", "act_fn"):
            setattr(self, name, getattr(module, name))
        self.has_post_expert_norm = getattr(module, "has_post_expert_norm", False)
        if self.has_post_expert_norm:
            self.post_expert_norm = module.post_expert_norm
        self._apply_gate = module._apply_gate  # bound to the real module
        self.num_experts = n_slots
        self._is_expert_parallel = False
        for name, slab in slabs.items():
            setattr(self, name, slab)
        self._windows: dict[tuple[str, int, int], torch.Tensor] = {}

    WINDOWS = 4096  # window views kept at most (a long call's buffers reuse a handful; decode's vary)

    def window(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Slots ``[lo, hi)`` of slab ``name`` as grouped_mm takes them (``[n, in, out]``): a view
        made once per window instead of a slice and a transpose per GEMM (on the H200's host,
        about 8% of a streamed part's GEMM launch time, ``prefill_split-qwen3_moe-trims.json``)."""
        key = (name, lo, hi)
        w = self._windows.get(key)
        if w is None:
            if len(self._windows) >= self.WINDOWS:
                self._windows.clear()
            w = getattr(self, name)[lo:hi]
            w = self._windows[key] = w if self.is_transposed else w.transpose(-2, -1)
        return w


def _proxy(module: torch.nn.Module, slabs: dict[str, torch.Tensor], n_slots: int) -> _SlotExperts:
    """The module's proxy over these slabs, made once (slabs never move)."""
    cache = module.__dict__.setdefault("_tiers_proxies", {})
    proxy = cache.get(id(slabs))
    if proxy is None:
        proxy = cache[id(slabs)] = _SlotExperts(module, slabs, n_slots)
    return proxy


def tiers_grouped_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    binding = _binding(self)
    mgr = binding.manager
    static = mgr.static_maps.get(binding.layer)
    if static is not None:  # every expert of this layer is hot: no sync, no staging, no events
        if not mgr.in_step:  # a step graph's runner counted it (``TierManager.begin_step``)
            mgr.count_static(binding.layer, top_k_index)
        # In generate's decode stage on a GPU, transformers runs its grouped_mm experts as
        # batched_mm; a layer whose experts are all hot does exactly what the untiered one does
        # (there replayed as a decode graph, where those are on).
        view = mgr.static_views.get(binding.layer)
        if view is not None:
            proxy, bound = _proxy(self, view, self.num_experts), tuple(view.values())
            if not mgr.decoding:
                return grouped_mm_experts_forward(proxy, hidden_states, top_k_index, top_k_weights)
            step = functools.partial(batched_mm_experts_forward, proxy)
        else:
            pool = mgr.pool_of[binding.layer]
            proxy, bound = _proxy(self, pool.slabs, pool.n_slots), (static, *pool.slabs.values())
            if not mgr.decoding:
                return grouped_mm_experts_forward(proxy, hidden_states, static[top_k_index], top_k_weights)

            def step(h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return batched_mm_experts_forward(proxy, h, static[idx], w)
        return mgr.graphs.run(("static", binding.layer), bound, step, (hidden_states, top_k_index, top_k_weights))
    if mgr.whole_layer(binding.layer, *top_k_index.shape):
        if len(mgr.unsettled) >= mgr.UNSETTLED_CALLS:  # else counted after the forward's last layer, or at the next call that waits
            mgr.settle(block=False)
        out = _grouped_whole(self, binding, hidden_states, top_k_index, top_k_weights)
        if out is not None:
            mgr.settle_after(binding.layer)
            return out
    if mgr.in_step:  # inside a step graph (``tiers.step_graph``): the device work alone
        ids = mgr.step_fetch(binding.layer, top_k_index)
        pool = mgr.pool_of[binding.layer]
        return batched_mm_experts_forward(_proxy(self, pool.slabs, pool.n_slots), hidden_states, ids, top_k_weights)
    mgr.settle()  # this call counts after the whole-layer calls before it
    noted = False
    if mgr.decoding and mgr.direct_ready(binding.layer, top_k_index.numel()):
        # a decode step whose misses the GPU reads from pinned memory itself: no sync, no staging
        ids = mgr.fetch_direct(binding.layer, top_k_index)  # [T, k] slots
        if ids is not None:
            pool = mgr.pool_of[binding.layer]
            proxy = _proxy(self, pool.slabs, pool.n_slots)

            def step(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return batched_mm_experts_forward(proxy, h, ids, w)
            return mgr.graphs.run(("direct", binding.layer), (ids, *pool.slabs.values()), step, (hidden_states, top_k_weights))
        noted = True  # the rebalancer moved an expert of this layer to disk: the host-routed path, already noted
    host = mgr.host_compute_for(hidden_states, top_k_index.shape[-1])
    if host is not None:  # the token comes down with the routing sync, in case the host computes some picks
        host.stage(hidden_states, top_k_weights.float())
    with torch.no_grad():
        hit, counts, picks = _route(self, binding, hidden_states, top_k_index)
    mgr.begin_call(binding.layer, hit, hidden_states.shape[0], noted=noted)
    mgr.note_share(binding.layer, hit, *top_k_index.shape)
    if not hit:  # no routed expert: grouped_mm would leave every row unwritten
        return torch.zeros_like(hidden_states)
    if host is not None and picks is not None:
        on_host = mgr.host_picks(binding.layer, picks)
        if on_host:
            return _split_call(self, binding, host, on_host, hidden_states, top_k_index, top_k_weights, picks)
    return _host_routed(self, binding, hidden_states, top_k_index, top_k_weights, hit, counts, picks)


def _split_call(self, binding: LayerBinding, host, on_host: list[int], hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, picks: list[int]) -> torch.Tensor:
    """One decode token whose picks at ``on_host`` (positions) the host computes
    (``tiers.cpu.compute``) while the GPU serves the others: the host's work is handed to its
    worker first, then the GPU's call is queued as a call of only its own picks, then the host's
    sum is added to its output."""
    mgr = binding.manager
    layer = binding.layer
    work = [(pos, *mgr.host_views(layer, picks[pos])) for pos in on_host]
    future = host.submit(self, work)
    hosted = set(on_host)
    keep = [p for p in range(len(picks)) if p not in hosted]
    if not keep:
        return host.finish(future, torch.zeros_like(hidden_states))
    sel = _positions(tuple(keep), top_k_index.device)
    kept = [picks[p] for p in keep]
    counts = _rows_per_expert(kept, self.num_experts)
    hit = [e for e in range(self.num_experts) if counts[e]]
    try:
        out = _host_routed(self, binding, hidden_states, top_k_index[:, sel], top_k_weights[:, sel], hit, counts, kept)
    except BaseException:
        future.exception()  # the worker reads the host pool: let it finish before anything moves
        raise
    return host.finish(future, out)


@functools.lru_cache(maxsize=None)
def _positions(keep: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The kept picks' positions as an index on ``device``, made once per set of positions."""
    return torch.tensor(keep, dtype=torch.int64, device=device)


def _host_routed(self, binding: LayerBinding, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 hit: list[int], counts: list[int], picks: list[int] | None) -> torch.Tensor:
    """A call whose routing the host has read: streamed, in parts, or all its experts held at once."""
    mgr = binding.manager
    pool = mgr.pool_of[binding.layer]
    need = sum(not mgr.table[ExpertKey(binding.layer, e)].pinned for e in hit)
    staging = pool.n_slots - mgr.hot_count[id(pool)]
    if picks is None and need > staging // 2:
        out = _grouped_streamed(self, binding, hidden_states, top_k_index, top_k_weights, counts, hit)
        if out is not None:
            return out
    held = mgr.acquire_layer(binding.layer, hit) if need <= staging else None
    if held is None:
        return _grouped_in_parts(self, binding, hidden_states, top_k_index, top_k_weights, counts, _chunks(mgr, binding.layer, hit))
    _prefetch(binding)
    try:
        proxy = _proxy(self, pool.slabs, pool.n_slots)
        if picks is not None:
            if mgr.decoding:  # generate's decode stage on a GPU: what the untiered model runs, over slots
                return _batched_host_routed(proxy, mgr, held, hidden_states, top_k_weights, picks, top_k_index.shape[-1])
            return _grouped_host_routed(proxy, mgr, held, hidden_states, top_k_weights, picks, top_k_index.shape[-1])
        return _grouped_device_routed(proxy, mgr, binding.layer, held, hidden_states, top_k_index, top_k_weights, counts)
    finally:
        mgr.release_all(held)


WINDOW_GAP = 8  # this many unused slots or more between two used ones: separate grouped GEMMs


def _windows(slot_rows: list[tuple[int, int]]) -> list[dict]:
    """Windows of the slab for grouped GEMMs over rows sorted by slot.

    ``slot_rows``: (slot, rows routed to it), ascending by slot, rows > 0. A grouped GEMM's cost
    grows with its number of groups, and one pool's slab holds the slots of many layers (Qwen3 at
    50%: 784), so each GEMM gets only a window ``[lo, hi)`` around used slots: a window closes when
    ``WINDOW_GAP`` or more unused slots lie between its last used slot and the next. Each window: its slots, its row range
    ``[a, b)``, and its per-slot cumulative row offsets relative to ``a``."""
    windows: list[dict] = []
    row = 0
    for slot, n in slot_rows:
        if not windows or slot - windows[-1]["hi"] >= WINDOW_GAP:
            windows.append({"lo": slot, "hi": slot, "a": row, "b": row, "offs": []})
        w = windows[-1]
        w["offs"].extend([row - w["a"]] * (slot - w["hi"]))  # empty slots inside the window
        row += n
        w["offs"].append(row - w["a"])
        w["hi"], w["b"] = slot + 1, row
    return windows


@functools.lru_cache(maxsize=None)
def _kernel_direct(device: torch.device) -> bool:
    """Whether transformers' grouped linear would run ``torch._grouped_mm`` itself on ``device``
    (CUDA, SM 80 or newer, a torch with ``nn.functional.grouped_mm``, which is that op): then
    the windows call it directly. transformers checks this before every GEMM, with a device
    capability query among other Python steps, on a host that bounds a long prefill."""
    return device.type == "cuda" and hasattr(torch.nn.functional, "grouped_mm") and torch.cuda.get_device_capability(device) >= (8, 0)


def _window_linear(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``_grouped_linear(input, weight, offs, bias, is_transposed=True)``, the same kernel and
    arithmetic, without its per-call checks where ``_kernel_direct`` holds."""
    if not _kernel_direct(weight.device):
        return _grouped_linear(input, weight, offs, bias=bias, is_transposed=True)
    out = torch._grouped_mm(input if input.dtype == weight.dtype else input.to(weight.dtype), weight, offs=offs)
    if bias is not None:
        out.add_(bias)  # as transformers adds it
    return out


def _run_windows(proxy: _SlotExperts, xs: torch.Tensor, windows: list[dict], offsets: torch.Tensor,
                 slot_ids: torch.Tensor | None) -> torch.Tensor:
    """The experts' MLP on ``xs`` (rows sorted by slot, ``[n, H]``), one pair of grouped GEMMs per
    window. ``offsets``: every window's offsets, concatenated (int32, on the device);
    ``slot_ids``: each row's slot, for biases."""
    up = "gate_up_proj" if proxy.has_gate else "up_proj"
    outs, at = [], 0
    for w in windows:
        lo, hi, a, b = w["lo"], w["hi"], w["a"], w["b"]
        offs = offsets[at : at + hi - lo]
        at += hi - lo
        bias = getattr(proxy, up + "_bias")[slot_ids[a:b]] if proxy.has_bias else None
        h = _window_linear(xs[a:b], proxy.window(up, lo, hi), offs, bias)  # [m, 2I] or [m, I]
        h = proxy._apply_gate(h) if proxy.has_gate else proxy.act_fn(h)  # [m, I]
        bias = proxy.down_proj_bias[slot_ids[a:b]] if proxy.has_bias else None
        outs.append(_window_linear(h, proxy.window("down_proj", lo, hi), offs, bias))  # [m, H]
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return proxy.post_expert_norm(y) if proxy.has_post_expert_norm else y


def _grouped_host_routed(proxy: _SlotExperts, mgr: TierManager, held: list, hidden_states: torch.Tensor,
                         top_k_weights: torch.Tensor, picks: list[int], k: int) -> torch.Tensor:
    """transformers' grouped_mm forward for a call whose picks the host knows (decode): the sort by
    slot, its inverse and the windows' offsets are made on the host and go up in one pinned copy,
    so the device runs the grouped GEMMs and a handful of gathers, nothing else."""
    slot_of = {h.key.expert: h.slot for h in held}
    slots = [slot_of[e] for e in picks]  # per (token, pick) row
    n = len(slots)
    order = sorted(range(n), key=slots.__getitem__)  # rows grouped by slot (stable)
    back = [0] * n
    for pos, row in enumerate(order):
        back[row] = pos
    per_slot: dict[int, int] = {}
    for s in slots:
        per_slot[s] = per_slot.get(s, 0) + 1
    windows = _windows(sorted(per_slot.items()))
    idx = mgr.upload_ints([row // k for row in order] + order + back + [slots[r] for r in order] + [o for w in windows for o in w["offs"]])
    tok, rows, inverse, slot_ids, offsets = idx[:n], idx[n : 2 * n], idx[2 * n : 3 * n], idx[3 * n : 4 * n], idx[4 * n :]
    mgr.wait_all(held)
    y = _run_windows(proxy, hidden_states[tok], windows, offsets, slot_ids)  # [n, H]
    y = y * top_k_weights.reshape(-1)[rows].unsqueeze(-1)  # [n, H]
    return y[inverse].view(-1, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)  # [T, H], summed as transformers does


class _Picked:
    """A weight slab as transformers' batched_mm forward sees it in ``_picked``: indexing it by the
    picks' ids, as that forward does to gather each pick's weights, gives a strided view of the
    picks' slots instead (no copy)."""

    def __init__(self, view: torch.Tensor):
        self.view = view

    def __getitem__(self, ids) -> torch.Tensor:
        return self.view


def _picked(proxy: _SlotExperts, slots: list[int]) -> _SlotExperts | None:
    """``proxy`` with each weight slab seen as just ``slots``, in order (``_Picked``), when they are
    two or fewer, distinct, and ascending: one strided view per slab (batch stride: the slots'
    distance), so transformers' batched_mm forward runs its own operations on the slots in place
    instead of first copying every pick's weights (Mixtral-8x7B's two picks: 672 MiB of bf16 per
    layer call). Else None. A slab's slots are equally shaped and strided, so each pick's GEMM
    reads the operand layout the gathered copy has."""
    if not 1 <= len(slots) <= 2 or (len(slots) == 2 and slots[1] <= slots[0]) or proxy.has_bias:
        return None
    picked = _SlotExperts.__new__(_SlotExperts)
    picked.__dict__.update(proxy.__dict__)
    lo, step = slots[0], (slots[-1] - slots[0]) or 1
    for name in ("gate_up_proj" if proxy.has_gate else "up_proj", "down_proj"):
        slab = getattr(proxy, name)
        view = slab.as_strided((len(slots), *slab.shape[1:]), (step * slab.stride(0), *slab.stride()[1:]),
                               slab.storage_offset() + lo * slab.stride(0))
        setattr(picked, name, _Picked(view))
    return picked


@functools.lru_cache(maxsize=None)
def _pick_ids(k: int) -> torch.Tensor:
    """The ids a ``_picked`` forward is called with: only their shape ([1, k]) is read (the
    weights' "gather" returns the views whatever the ids), so they hold no data."""
    return torch.empty((1, k), dtype=torch.int64, device="meta")


def _batched_host_routed(proxy: _SlotExperts, mgr: TierManager, held: list, hidden_states: torch.Tensor,
                         top_k_weights: torch.Tensor, picks: list[int], k: int) -> torch.Tensor:
    """transformers' batched_mm forward (its decode kernels on a GPU) with each pick's slot as its
    expert id: one upload of the ids, then exactly the untiered model's decode operations. One
    token's one or two picks (Mixtral's decode) skip the weights' gather: in ascending slot order
    (their weights swapped with them; a sum of two is the same either way) the forward runs on
    strided views of their slots (``_picked``)."""
    slot_of = {h.key.expert: h.slot for h in held}
    slots = [slot_of[e] for e in picks]
    if hidden_states.shape[0] == 1:  # one token: its k picks
        swap = len(slots) == 2 and slots[1] < slots[0]
        picked = _picked(proxy, slots[::-1] if swap else slots)
        if picked is not None:
            mgr.wait_all(held)
            return batched_mm_experts_forward(picked, hidden_states, _pick_ids(k), top_k_weights.flip(-1) if swap else top_k_weights)
    ids = mgr.upload_ints(slots, dtype=torch.int64).view(-1, k)  # [T, k] slots
    mgr.wait_all(held)
    return batched_mm_experts_forward(proxy, hidden_states, ids, top_k_weights)


def _sorted_by_slot(mgr: TierManager, layer: int, held: list, expert_ids: torch.Tensor, counts: list[int]):
    """Rows of ``expert_ids`` (flat, on the device) sorted by their expert's slot, and the windows.
    Host-side counts per expert give the windows without a sync; rows of experts not held (the
    sentinel, other parts) sort last and fall outside every window."""
    mgr.wait_all(held)
    experts = [h.key.expert for h in held]
    slot_of = mgr.slot_map(layer, experts, [h.slot for h in held])  # [E+1] expert -> slot, the rest -> n_slots
    slot_ids, order = torch.sort(slot_of[expert_ids], stable=True)  # [m]
    windows = _windows(sorted((h.slot, counts[h.key.expert]) for h in held if counts[h.key.expert]))
    offsets = mgr.upload_ints([o for w in windows for o in w["offs"]])
    return slot_ids, order, windows, offsets


def _grouped_device_routed(proxy: _SlotExperts, mgr: TierManager, layer: int, held: list, hidden_states: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The whole call in one go when its picks stay on the device (prefill): sorted by slot there,
    windows from the host-side counts, then summed over each token's picks as transformers does."""
    k = top_k_index.shape[-1]
    slot_ids, order, windows, offsets = _sorted_by_slot(mgr, layer, held, top_k_index.reshape(-1), counts)
    routed = windows[-1]["b"] if windows else 0
    rows = order[:routed]
    y = _run_windows(proxy, hidden_states[rows // k], windows, offsets, slot_ids)  # [routed, H]
    y = y * top_k_weights.reshape(-1)[rows].unsqueeze(-1)
    out = torch.zeros(order.shape[0], y.shape[-1], dtype=y.dtype, device=y.device).index_copy_(0, rows, y)  # [T*k, H]
    return out.view(-1, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)


STREAM_KEY_END = 2**31 - 1  # the sort key of rows no part serves (the sentinel expert, unrouted ids)


def _grouped_streamed(self, binding: LayerBinding, hidden_states, top_k_index, top_k_weights, counts: list[int], hit: list[int]) -> torch.Tensor | None:
    """A long call streamed through reserved slots (``tiers.streamed``), or None if it does not
    qualify. Every (token, pick) row gets the sort key ``group * n_slots + slot`` (group 0: the
    experts held in hot slots; group p + 1: the stream's part p), uploaded once as a map expert -> key, so one
    sort on the device orders the rows for every part; each part's row range and windows come
    from the host-side counts. Part ``p + 1``'s reads are queued before part ``p``'s kernels."""
    mgr = binding.manager
    s = mgr.begin_stream(binding.layer, hit)
    if s is None:
        return None
    try:
        # the first parts read into their buffers, which only wait for the call's start: queued
        # first, so the copy engine runs while the host builds the sort keys below
        for p in range(min(len(s.buffers), len(s.parts))):
            mgr.stream_part(s, p)
        n_slots, k = s.pool.n_slots, top_k_index.shape[-1]
        groups, key_of = _stream_keys(s, self.num_experts)
        # every part's windows from the host-side counts, their offsets uploaded with the keys
        windows = [_windows(sorted((slot, counts[e]) for slot, e in g if counts[e])) for g in groups]
        key_map, *offsets = mgr.upload_int_lists([key_of] + [[o for w in ws for o in w["offs"]] for ws in windows])
        keys = key_map[top_k_index.reshape(-1)]  # [T*k]
        sorted_keys, order = torch.sort(keys, stable=True)
        routed = sum(counts[e] for e in hit)
        order = order[:routed]  # rows by (part, slot)
        xs = hidden_states[order // k]  # [routed, H]
        slot_ids = sorted_keys[:routed] % n_slots if self.has_bias else None  # [routed], for biases
        proxy = _proxy(self, s.pool.slabs, n_slots)
        outs, row = [], 0

        def run(i: int) -> None:
            nonlocal row
            if not windows[i]:
                return
            n = windows[i][-1]["b"]
            outs.append(_run_windows(proxy, xs[row : row + n], windows[i], offsets[i], None if slot_ids is None else slot_ids[row : row + n]))
            row += n

        _run_parts(mgr, s, run, held_after=-1)
        y = (outs[0] if len(outs) == 1 else torch.cat(outs)) * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # [routed, H]
        out = torch.zeros(top_k_index.numel(), y.shape[-1], dtype=y.dtype, device=y.device).index_copy_(0, order, y)  # [T*k, H]
        return out.view(-1, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)
    finally:
        mgr.end_stream(s)
        # into half the slots just given back, behind this call's kernels: a long next call finds
        # those resident and streams its other misses through the other half
        limit = (s.pool.n_slots - mgr.hot_count[id(s.pool)]) // 2
        if binding.lookahead:
            _prefetch(binding, limit, direct=mgr.stream_direct)
        else:  # no router predictions: the next layer in expert order, if this call is long enough
            mgr.stage_ahead(binding.layer, hidden_states.shape[0], top_k_index.shape[-1], limit)


def _run_parts(mgr: TierManager, s, run, held_after: int) -> None:
    """Queue a streamed call's kernels, ``run(g)`` for group ``g`` (0: the held experts, p + 1:
    part p), the reads of its first parts (one per buffer) already queued: before part p's
    kernels, which wait for part p's reads, part p + n - 1's reads are queued into the buffer of
    part p - 1 (n buffers); the held experts' kernels follow part ``held_after`` (-1: first)."""
    n = len(s.buffers)
    if held_after < 0:
        mgr.wait_all(s.held)
        run(0)
    for p in range(len(s.parts)):
        if p > 0 and p + n - 1 < len(s.parts):
            mgr.stream_part(s, p + n - 1)  # into part p - 1's buffer, after its kernels
        mgr.wait_part(s, p)
        run(p + 1)
        mgr.end_part(s, p)
        if p == held_after:
            mgr.wait_all(s.held)
            run(0)


def _slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """Ascending ``slots`` as windows ``[lo, hi)``, split where ``WINDOW_GAP`` or more slots lie
    between two of them (as ``_windows`` splits used slots)."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and slot - runs[-1][1] < WINDOW_GAP:
            runs[-1][1] = slot + 1
        else:
            runs.append([slot, slot + 1])
    return [(lo, hi) for lo, hi in runs]


@dataclass
class _WholePlan:
    """A whole-layer call's plan, made on the host from its slots alone (no routing).

    Every expert's rows get ``_stream_keys``' sort key ``group * n_slots + slot``. The call's
    bounds are those keys for every group and every slot ``0..n_slots`` in a fixed order, bound
    ``group * (n_slots + 1) + slot`` (the universe of the call's ``n_groups`` groups), so one
    ``searchsorted`` of them in the sorted keys gives every slot's first row, and a window's
    first bound is a function of its own group and first slot alone, whatever the layout of the
    other windows, and the plan's own shapes change only with the number of groups and of
    windows. A window's rows sit at its index among the call's windows in the plan's outputs, so
    that index is part of its graph's key (``TierManager.whole_graphs``): a window added or
    dropped before it recaptures it. Each group's slots split into windows, one per grouped
    GEMM."""

    key_of: list[int]  # expert id (sentinel included) -> sort key
    n_groups: int
    segments: list[tuple[int, int, int, int]]  # (group, lo, hi, index of its first bound), in group order
    ends: list[tuple[int, int]]  # (expert, index of the bound its rows end at; they start at the one before)


def _stream_keys(s, num_experts: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """A streamed call's groups of (slot, expert) (group 0: the held experts; group p + 1: part
    p), and each expert id's sort key ``group * n_slots + slot`` (sentinel and experts outside
    the call: ``STREAM_KEY_END``)."""
    n_slots = s.pool.n_slots
    groups = [[(h.slot, h.key.expert) for h in s.held]] + [list(zip(s.slots(p), part)) for p, part in enumerate(s.parts)]
    key_of = [STREAM_KEY_END] * (num_experts + 1)
    for g, pairs in enumerate(groups):
        for slot, e in pairs:
            key_of[e] = g * n_slots + slot
    return groups, key_of


def _whole_plan(s, num_experts: int) -> _WholePlan:
    span = s.pool.n_slots + 1  # bounds per group
    groups, key_of = _stream_keys(s, num_experts)
    segments, ends = [], []
    for g, pairs in enumerate(groups):
        expert_at = dict(pairs)  # slot -> expert
        for lo, hi in _slot_runs(sorted(expert_at)):
            segments.append((g, lo, hi, g * span + lo))
        ends.extend((e, g * span + slot + 1) for slot, e in pairs)
    return _WholePlan(key_of, len(groups), segments, ends)


def _grouped_whole(self, binding: LayerBinding, hidden_states, top_k_index, top_k_weights) -> torch.Tensor | None:
    """A whole-layer call (``tiers.streamed``): every warm expert of the layer streamed through the
    reserved slots, with no host sync, or None if it does not qualify. The rows are sorted once
    by key (``_WholePlan``); each window then gathers its rows into a buffer of ``T * min(k,
    slots)`` rows, as many as it can get (a token's picks are distinct), whose grouped GEMMs run
    over the rows its device-side offsets cover; rows past them go to a spare output row. The
    held experts run after parts 0 and 1, whose reads were queued first, so the copy engine
    reads part 2 while they run."""
    mgr = binding.manager
    T, k = top_k_index.shape
    s = mgr.begin_stream(binding.layer, list(range(self.num_experts)), whole=(T, k))
    if s is None:
        return None
    plan = _whole_plan(s, self.num_experts)
    done = False
    try:
        firsts = [f for *_, f in plan.segments]
        lasts = [f + hi - lo for _, lo, hi, f in plan.segments]
        # the plan goes up on the copy stream ahead of the parts' reads: on the compute stream it
        # would wait for the copy engine to finish the first parts' reads
        uploaded = mgr.upload_int_lists([plan.key_of, firsts, lasts, [i for _, i in plan.ends]],
                                        on=mgr.copy_stream if mgr.WHOLE_PLAN_ON_COPY else None)
        for p in range(min(len(s.buffers), len(s.parts))):
            mgr.stream_part(s, p)
        n_slots, rows_n, layer = s.pool.n_slots, T * k, binding.layer
        cap = T * min(k, max(hi - lo for _, lo, hi, _ in plan.segments))
        out = mgr.whole_out((rows_n + 1, hidden_states.shape[-1]), torch.promote_types(s.pool.dtype, top_k_weights.dtype),
                            hidden_states.device)  # [T*k + 1, H] as the GEMMs' rows times their weights
        has_bias, span = self.has_bias, n_slots + 1
        n_bounds = plan.n_groups * span

        def plan_step(key_map, first_at, last_at, end_at, top_k_index, top_k_weights, hidden_states):
            sorted_keys, order = torch.sort(key_map[top_k_index.reshape(-1)], stable=True)  # [T*k]
            u = torch.arange(n_bounds, device=sorted_keys.device)  # bound g * span + s is key g * n_slots + s
            at = torch.searchsorted(sorted_keys, (u - u // span).to(sorted_keys.dtype))  # [U] rows before each bound
            # per bound: its window's first bound (the last first at or before it), and its rows'
            # end from that window's first row (bounds outside windows: unused)
            first = torch.zeros(n_bounds, dtype=torch.bool, device=u.device).index_fill_(0, first_at.long(), True)
            base = torch.where(first, u, 0).cummax(0).values
            offs = (at - at[base]).to(torch.int32)  # [U]
            routed = at[end_at] - at[end_at - 1]  # [E] rows per expert, in plan.ends' order
            pos = at[first_at].unsqueeze(1) + torch.arange(cap, device=at.device)  # [S, cap] sorted row of each buffer row
            valid = pos < at[last_at].unsqueeze(1)
            src = order[pos.clamp_(max=rows_n - 1)]  # [S, cap] flat (token, pick) row
            dest = torch.where(valid, src, rows_n)  # rows past the window's -> the spare row
            tok = torch.div(src, k, rounding_mode="floor")  # [S, cap]
            weights = top_k_weights.reshape(-1)[src].unsqueeze(-1)  # [S, cap, 1]
            out.zero_()
            got = (hidden_states, routed, offs, tok, weights, dest)
            return got + (sorted_keys[pos] % n_slots,) if has_bias else got

        # the plan's outputs (and the hidden states) are a graph's static tensors once it replays,
        # which the windows' graphs bind
        planned = mgr.whole_graphs.run(("whole_plan", layer, cap, n_slots, plan.n_groups), (out,), plan_step,
                                       (*uploaded, top_k_index, top_k_weights, hidden_states), fresh=False)
        xs_all, routed, offs, tok, weights, dest = planned[:6]
        slot_ids = planned[6] if has_bias else None
        proxy = _proxy(self, s.pool.slabs, n_slots)
        bound = (xs_all, offs, tok, weights, dest, out, slot_ids, *s.pool.slabs.values())
        by_group: dict[int, list[int]] = {}
        for j, (g, *_) in enumerate(plan.segments):
            by_group.setdefault(g, []).append(j)

        def window_step(j: int, lo: int, hi: int, f: int, c: int):
            xs = xs_all[tok[j, :c]]  # [c, H]
            y = _run_windows(proxy, xs, [{"lo": lo, "hi": hi, "a": 0, "b": c}], offs[f + 1 : f + 1 + hi - lo],
                             None if slot_ids is None else slot_ids[j, :c])
            out.index_copy_(0, dest[j, :c], y * weights[j, :c])
            return out[:0]  # nothing of its own: a graph keeps its outputs, and y is [c, H]

        def run(g: int) -> None:
            for j in by_group.get(g, ()):
                _, lo, hi, f = plan.segments[j]
                c = T * min(k, hi - lo)
                mgr.whole_graphs.run(("whole_window", layer, j, lo, hi, f, c), bound,
                                     lambda j=j, lo=lo, hi=hi, f=f, c=c: window_step(j, lo, hi, f, c), (), fresh=False)

        _run_parts(mgr, s, run, held_after=min(1, len(s.parts) - 1))
        done = True
        return out[:rows_n].view(T, k, -1).sum(dim=1).to(hidden_states.dtype)
    finally:
        mgr.end_stream(s)
        if done:
            mgr.defer_whole(s, routed, [e for e, _ in plan.ends])


def _grouped_in_parts(self, binding: LayerBinding, hidden_states, top_k_index, top_k_weights, counts: list[int], chunks: list[list[int]]) -> torch.Tensor:
    """A call whose experts do not fit the staging slots at once, in parts of consecutive experts.

    The (token, pick) rows are sorted by expert once; a part's rows are then one contiguous range
    (its bounds come from the host-side counts, no sync), which is sorted by slot and run through
    the windows' grouped GEMMs, and its output is added into an fp32 sum per token."""
    mgr = binding.manager
    pool = mgr.pool_of[binding.layer]
    k = top_k_index.shape[-1]
    sorted_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)  # [T*k]
    weights = top_k_weights.reshape(-1)  # [T*k]
    start = [0]
    for c in counts:
        start.append(start[-1] + c)  # start[e]: first sorted row of expert e
    acc = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)  # [T, H]
    proxy = _proxy(self, pool.slabs, pool.n_slots)
    for i, chunk in enumerate(chunks):
        held = mgr.acquire_layer(binding.layer, chunk)
        assert held is not None, f"layer {binding.layer}: experts {chunk} do not fit the staging slots"
        if i == len(chunks) - 1:  # the last part's copies are queued: stage the next layers behind them
            _prefetch(binding)
        try:
            a, b = start[chunk[0]], start[chunk[-1] + 1]
            slot_ids, by_slot, windows, offsets = _sorted_by_slot(mgr, binding.layer, held, sorted_ids[a:b], counts)
            rows = order[a:b][by_slot]  # [n] flat (token, pick) rows of this part, by slot
            tok = rows // k  # [n]
            part = _run_windows(proxy, hidden_states[tok], windows, offsets, slot_ids)  # [n, H]
            acc.index_add_(0, tok, (part * weights[rows].unsqueeze(-1)).float())
        finally:
            mgr.release_all(held)
    return acc.to(hidden_states.dtype)


def _chunks(mgr, layer: int, experts: list[int]) -> list[list[int]]:
    """Split a layer's experts into parts of at most half the staging slots each (hot experts are
    free; every other one needs a slot, since one cached now may be evicted by the part's own
    misses). Half, so a part's copies go into slots the part before it is not reading: they are
    queued behind that part's copies and overlap its kernels (double buffering)."""
    pool = mgr.pool_of[layer]
    room = max(1, (pool.n_slots - mgr.hot_count[id(pool)]) // 2)
    parts, cur, misses = [], [], 0
    for e in experts:
        miss = not mgr.table[ExpertKey(layer, e)].pinned
        if miss and misses == room:
            parts.append(cur)
            cur, misses = [], 0
        cur.append(e)
        misses += miss
    parts.append(cur)
    return parts


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:
        out = x @ w  # [n, in] @ [in, out]
        return out + b if b is not None else out
    return torch.nn.functional.linear(x, w, b)  # [n, in] x [out, in]^T


def _register() -> None:
    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, tiers_experts_forward)
    if GROUPED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(GROUPED, tiers_grouped_experts_forward)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected cuda or cpu, got {device}")
    return device


def _load_dense(model: torch.nn.Module, manifest: Manifest, expert_params: set[str], device: torch.device) -> None:
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in expert_params}
    loaded: dict[str, torch.Tensor] = {}
    for fname, info in manifest.dense_files.items():
        path = manifest.root / fname
        if not path.is_file():
            raise IntegrityError(f"dense weights file {str(path)!r} is missing")
        if path.stat().st_size != info["nbytes"] or file_crc32(path) != info["crc32"]:
            raise IntegrityError(f"dense weights file {str(path)!r} is corrupt or truncated (size or crc32 differs from the manifest); re-pack")
        with safe_open(path, framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key not in expected:
                    raise ValueError(f"{str(path)!r}: tensor {key!r} is not a weight of this model")
                t = f.get_tensor(key)
                ref = expected[key]
                if tuple(t.shape) != tuple(ref.shape):
                    raise ValueError(f"{str(path)!r}: {key!r} has shape {tuple(t.shape)}, the model expects {tuple(ref.shape)}")
                loaded[key] = t.to(ref.dtype)
    model.load_state_dict(loaded, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta" and n not in expert_params]
    if still_meta:
        raise ValueError(f"packed checkpoint {str(manifest.root)!r} lacks dense weights {still_meta[:8]}")
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def load(
    path: str | Path,
    config: str | Path | dict | TiersConfig | None = None,
    *,
    device: str | torch.device | None = None,
    verify: str = "first",
    progress: bool = True,
    streams: Streams | None = None,
    routing: str | Path | dict | None = None,
) -> PreTrainedModel:
    """Load a packed checkpoint as a transformers model whose experts are served from the tiers.

    ``config`` is a YAML path, a parsed dict, a ``TiersConfig`` or None (defaults: gpu 25%,
    cpu 50% as int8, the rest int8 on disk). ``device`` defaults to cuda when available.
    ``routing``: a routing file written by ``save_routing`` (or its parsed document); the hot and
    warm sets then start as the experts it counts most. Without one, the checkpoint's routing
    prior ranks them if it has one (``tools/pack.py --routing``), else round-robin over layers.
    """
    cfg = load_config(config)
    manifest = read_manifest(path)
    dev = _resolve_device(device)
    placement = plan_placement(cfg, manifest, read_routing(routing, manifest) if routing is not None else None)
    if not (manifest.root / "config.json").is_file():
        raise ValueError(f"packed checkpoint {str(manifest.root)!r} has no config.json; re-pack it from a save_pretrained directory")
    hf_config = AutoConfig.from_pretrained(manifest.root)
    model = build_skeleton(hf_config, dtype=torch.bfloat16)
    modules = find_experts_modules(model)
    if sorted(modules) != sorted(manifest.layers):
        raise ValueError(f"{str(manifest.root)!r}: manifest MoE layers {sorted(manifest.layers)} differ from the model's {sorted(modules)}")
    expert_params: set[str] = set()
    for layer, (name, mod) in modules.items():
        entry = manifest.layers[layer]
        if discover_layout(mod) != entry.layout or name != entry.module:
            raise ValueError(f"{str(manifest.root)!r}: layer {layer} ({name}) does not match the packed layout; re-pack")
        expert_params |= {f"{name}.{t.name}" for t in entry.layout.tensors}
        why = host_compute.supported(mod) if cfg.cpu.compute else None
        if why is not None:
            raise ValueError(f"tiers.cpu.compute: the host cannot compute layer {layer}'s experts ({name}, {type(mod).__name__}): {why}; "
                             "set tiers.cpu.compute: false")
    _load_dense(model, manifest, expert_params, dev)
    manager = TierManager(manifest, cfg, placement, device=dev, streams=streams, verify=verify, progress=progress)
    order = sorted(modules)
    routers = {layer: _router_weight(model, name, mod) for layer, (name, mod) in modules.items()} if cfg.gpu.prefetch_depth else {}
    for i, (layer, (_, mod)) in enumerate(sorted(modules.items())):
        ahead = tuple((L, routers[L]) for L in order[i + 1 : i + 1 + cfg.gpu.prefetch_depth] if routers.get(L) is not None)
        mod._tiers_binding = LayerBinding(layer, manager, ahead)
    _register()
    model.set_experts_implementation(GROUPED if cfg.gpu.compute == "grouped" else IMPLEMENTATION)
    on_cuda_grouped = dev.type == "cuda" and cfg.gpu.compute == "grouped" and not cfg.cpu.compute
    if cfg.gpu.step_graphs and on_cuda_grouped:
        step_graph.install(model, manager)
    _follow_decode_switch(model, manager)
    if (manifest.root / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(manifest.root)
    setattr(model, _MANAGER_ATTR, manager)
    return model.eval()


def _follow_decode_switch(model: PreTrainedModel, manager: TierManager) -> None:
    """transformers' generate runs its decode stage inside ``model._optimize_model_for_decode()``,
    which on a GPU swaps grouped_mm experts for batched_mm (fewer kernels for a token or a few).
    The tiers implementation is not swapped; it learns of the stage here instead, so layers whose
    experts are all hot run what the untiered model runs. A transformers without the hook leaves
    ``manager.decoding`` False: grouped kernels throughout."""
    enter = getattr(model, "_optimize_model_for_decode", None)
    if enter is None:
        return

    @contextlib.contextmanager
    def optimize_for_decode():
        before = manager.decoding
        manager.decoding = manager.batched_decode
        if manager.decoding and not before:
            manager.begin_decode()
            if manager.steps is not None:
                manager.steps.begin_stage()
        try:
            with enter():
                yield
        finally:
            if manager.decoding and not before:
                if manager.steps is not None:
                    manager.steps.end_stage()  # generate's cache gets what the step graphs wrote
                manager.end_decode()
            manager.decoding = before

    model._optimize_model_for_decode = optimize_for_decode


def _router_weight(model: torch.nn.Module, experts_name: str, experts: torch.nn.Module) -> torch.Tensor | None:
    """The router of an MoE block: a weight of shape [num_experts, hidden] beside the experts module."""
    parent = model.get_submodule(experts_name.rpartition(".")[0])
    hidden = experts.hidden_dim if hasattr(experts, "hidden_dim") else None
    for name, p in parent.named_parameters():
        if name.startswith("experts.") or p.dim() != 2:
            continue
        if p.shape[0] == experts.num_experts and (hidden is None or p.shape[1] == hidden) and p.device.type != "meta":
            return p.detach()
    return None


def manager_of(model: torch.nn.Module) -> TierManager:
    m = getattr(model, _MANAGER_ATTR, None)
    if m is None:
        raise ValueError("this model was not loaded with tiers.load")
    return m


def stats(model: torch.nn.Module) -> TierStats:
    """Hits and misses per tier, bytes moved per source tier, copy and stall time, residency."""
    return manager_of(model).stats()


def routing_counts(model: torch.nn.Module) -> dict:
    """The routing the rebalancer has counted (its window: the last ``window`` × ``every_tokens``
    tokens), as a routing document for ``save_routing`` or ``load(..., routing=)``. Routing is
    counted only with the rebalancer on (``tiers.rebalance.every_tokens`` > 0)."""
    manager = manager_of(model)
    if manager.rebalancer is None:
        raise ValueError("routing_counts: this model counts no routing; load it with tiers.rebalance.every_tokens > 0 "
                         "(and a gpu budget below every expert's bytes) to count it")
    manager.settle()  # whole-layer calls not yet counted count now
    counts, tokens = manager.rebalancer.routing_counts()
    return routing_document(counts, tokens)


def save_routing(model: torch.nn.Module, path: str | Path) -> Path:
    """Write the routing the model has counted (``routing_counts``) to ``path`` as JSON, so that a
    later ``load(..., routing=path)`` starts with the hot and warm sets it would have settled on.
    The file is replaced whole or not at all."""
    return write_routing(routing_counts(model), path)
