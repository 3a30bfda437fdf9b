"""The experts' arithmetic over GPU slots: transformers' own forwards, with each expert's weights read in its slot.

Owns the kernels every path shares, all bit-identical to what the untiered model computes:

- ``SlotExperts``: the experts module seen through the slots (``<tensor>[slot]`` is the expert in
  that slot), on which transformers' ``grouped_mm`` and ``batched_mm`` forwards run unchanged
  with expert ids mapped to slot ids;
- ``run_windows``: the experts' MLP over rows sorted by slot, one pair of grouped GEMMs per
  window of the slabs around the used slots (a pool's slab holds the slots of many layers, and a
  grouped GEMM's cost grows with its groups);
- ``grouped`` and ``batched``: a held call's output, summed per token as transformers sums it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.integrations.moe import batched_mm_experts_forward

try:  # the grouped linear transformers' grouped_mm forward runs (kernel choice, CPU alignment fallback)
    from transformers.integrations.moe import _grouped_linear
except ImportError:  # a transformers without it: the same operation on torch's grouped_mm
    def _grouped_linear(input, weight, offs, bias=None, is_transposed=False):
        out = torch._grouped_mm(input.to(weight.dtype), weight if is_transposed else weight.transpose(-2, -1), offs=offs)
        return out + bias if bias is not None else out

from tiers.transfer.uploads import Uploads

WINDOW_GAP = 8  # this many unused slots or more between two used ones: separate grouped GEMMs


class SlotExperts:
    """The experts module seen through the slots; transformers' forwards run on it unchanged."""

    WINDOWS = 4096  # window views kept at most (a long call's buffers reuse a handful; decode's vary)

    def __init__(self, module: torch.nn.Module, slabs: dict[str, torch.Tensor], n_slots: int):
        for name in ("has_gate", "has_bias", "is_transposed", "is_concatenated"):
            setattr(self, name, getattr(module, name))
        if hasattr(module, "act_fn"):  # an ungated module's activation; a module with its own gate may have none
            self.act_fn = module.act_fn
        self.has_post_expert_norm = getattr(module, "has_post_expert_norm", False)
        if self.has_post_expert_norm:
            self.post_expert_norm = module.post_expert_norm
        self._apply_gate = module._apply_gate  # bound to the real module
        self.num_experts = n_slots
        self._is_expert_parallel = False
        for name, slab in slabs.items():
            setattr(self, name, slab)
        self._windows: dict[tuple[str, int, int], torch.Tensor] = {}

    def window(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Slots ``[lo, hi)`` of slab ``name`` as grouped_mm takes them (``[n, in, out]``), a view
        made once per window (on the H200's host, a slice and a transpose per GEMM were about 8%
        of a streamed part's GEMM launch time)."""
        key = (name, lo, hi)
        w = self._windows.get(key)
        if w is None:
            if len(self._windows) >= self.WINDOWS:
                self._windows.clear()
            w = getattr(self, name)[lo:hi]
            w = self._windows[key] = w if self.is_transposed else w.transpose(-2, -1)
        return w


def proxy(module: torch.nn.Module, slabs: dict[str, torch.Tensor], n_slots: int) -> SlotExperts:
    """The module's proxy over these slabs, made once (slabs never move)."""
    cache = module.__dict__.setdefault("_tiers_proxies", {})
    got = cache.get(id(slabs))
    if got is None:
        got = cache[id(slabs)] = SlotExperts(module, slabs, n_slots)
    return got


def windows(slot_rows: list[tuple[int, int]]) -> list[dict]:
    """Windows of the slab for grouped GEMMs over rows sorted by slot. ``slot_rows``: (slot, rows
    routed to it), ascending by slot, rows > 0. A window closes when ``WINDOW_GAP`` or more unused
    slots lie between its last used slot and the next. Each window: its slots ``[lo, hi)``, its
    row range ``[a, b)``, and its per-slot cumulative row offsets relative to ``a``."""
    out: list[dict] = []
    row = 0
    for slot, n in slot_rows:
        if not out or slot - out[-1]["hi"] >= WINDOW_GAP:
            out.append({"lo": slot, "hi": slot, "a": row, "b": row, "offs": []})
        w = out[-1]
        w["offs"].extend([row - w["a"]] * (slot - w["hi"]))  # empty slots inside the window
        row += n
        w["offs"].append(row - w["a"])
        w["hi"], w["b"] = slot + 1, row
    return out


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """Ascending ``slots`` as windows ``[lo, hi)``, split as ``windows`` splits used slots."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and slot - runs[-1][1] < WINDOW_GAP:
            runs[-1][1] = slot + 1
        else:
            runs.append([slot, slot + 1])
    return [(lo, hi) for lo, hi in runs]


@functools.lru_cache(maxsize=None)
def _kernel_direct(device: torch.device) -> bool:
    """Whether transformers' grouped linear would run ``torch._grouped_mm`` itself on ``device``
    (CUDA, SM 80 or newer, a torch with ``nn.functional.grouped_mm``): then the windows call it
    directly, without transformers' per-GEMM checks (a host-bound prefill pays for each)."""
    return device.type == "cuda" and hasattr(torch.nn.functional, "grouped_mm") and torch.cuda.get_device_capability(device) >= (8, 0)


def _window_linear(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``_grouped_linear(input, weight, offs, bias, is_transposed=True)``: the same kernel and arithmetic."""
    if not _kernel_direct(weight.device):
        return _grouped_linear(input, weight, offs, bias=bias, is_transposed=True)
    out = torch._grouped_mm(input if input.dtype == weight.dtype else input.to(weight.dtype), weight, offs=offs)
    if bias is not None:
        out.add_(bias)  # as transformers adds it
    return out


def run_windows(px: SlotExperts, xs: torch.Tensor, wins: list[dict], offsets: torch.Tensor, slot_ids: torch.Tensor | None) -> torch.Tensor:
    """The experts' MLP on ``xs`` (rows sorted by slot, ``[n, H]``), one pair of grouped GEMMs per
    window. ``offsets``: every window's offsets, concatenated (int32, on the device);
    ``slot_ids``: each row's slot, for biases."""
    up = "gate_up_proj" if px.has_gate else "up_proj"
    outs, at = [], 0
    for w in wins:
        lo, hi, a, b = w["lo"], w["hi"], w["a"], w["b"]
        offs = offsets[at : at + hi - lo]
        at += hi - lo
        bias = getattr(px, up + "_bias")[slot_ids[a:b]] if px.has_bias else None
        h = _window_linear(xs[a:b], px.window(up, lo, hi), offs, bias)  # [m, 2I] or [m, I]
        h = px._apply_gate(h) if px.has_gate else px.act_fn(h)  # [m, I]
        bias = px.down_proj_bias[slot_ids[a:b]] if px.has_bias else None
        outs.append(_window_linear(h, px.window("down_proj", lo, hi), offs, bias))  # [m, H]
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return px.post_expert_norm(y) if px.has_post_expert_norm else y


def grouped_picks(px: SlotExperts, uploads: Uploads, hidden_states: torch.Tensor, top_k_weights: torch.Tensor,
                  slots: list[int], k: int, wait: Callable[[], None]) -> torch.Tensor:
    """transformers' grouped_mm forward for a call whose picks' slots the host knows (``slots``, per
    (token, pick) row): the sort by slot, its inverse and the windows' offsets are made on the
    host and go up in one pinned copy; ``wait`` orders the compute stream after the slots' writes."""
    n = len(slots)
    order = sorted(range(n), key=slots.__getitem__)  # rows grouped by slot (stable)
    back = [0] * n
    for pos, row in enumerate(order):
        back[row] = pos
    per_slot: dict[int, int] = {}
    for s in slots:
        per_slot[s] = per_slot.get(s, 0) + 1
    wins = windows(sorted(per_slot.items()))
    idx = uploads.ints([row // k for row in order] + order + back + [slots[r] for r in order] + [o for w in wins for o in w["offs"]])
    tok, rows, inverse, slot_ids, offsets = idx[:n], idx[n : 2 * n], idx[2 * n : 3 * n], idx[3 * n : 4 * n], idx[4 * n :]
    wait()
    y = run_windows(px, hidden_states[tok], wins, offsets, slot_ids)  # [n, H]
    y = y * top_k_weights.reshape(-1)[rows].unsqueeze(-1)  # [n, H]
    return y[inverse].view(-1, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)  # [T, H], summed as transformers does


def grouped_device(px: SlotExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   slot_of: torch.Tensor, slot_rows: list[tuple[int, int]], offsets: torch.Tensor) -> torch.Tensor:
    """The whole call when its picks stay on the device (prefill): rows sorted by slot there
    (``slot_of``: expert -> slot, ``[E+1]``; unheld experts sort last, outside every window), the
    windows from the host-side counts (``slot_rows``), summed over each token's picks."""
    k = top_k_index.shape[-1]
    slot_ids, order = torch.sort(slot_of[top_k_index.reshape(-1)], stable=True)  # [T*k]
    wins = windows(slot_rows)
    routed = wins[-1]["b"] if wins else 0
    rows = order[:routed]
    y = run_windows(px, hidden_states[rows // k], wins, offsets, slot_ids)  # [routed, H]
    y = y * top_k_weights.reshape(-1)[rows].unsqueeze(-1)
    out = torch.zeros(order.shape[0], y.shape[-1], dtype=y.dtype, device=y.device).index_copy_(0, rows, y)  # [T*k, H]
    return out.view(-1, k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)


class _Picked:
    """A weight slab as transformers' batched_mm forward sees it in ``picked``: indexing it by the
    picks' ids, as that forward does to gather each pick's weights, gives a strided view of the
    picks' slots instead (no copy)."""

    def __init__(self, view: torch.Tensor):
        self.view = view

    def __getitem__(self, ids) -> torch.Tensor:
        return self.view


def picked(px: SlotExperts, slots: list[int]) -> SlotExperts | None:
    """``px`` with each weight (and bias) slab seen as just ``slots``, in order, when they are two
    or fewer, distinct and ascending (else None): one strided view per slab, so transformers' batched_mm
    forward runs on the slots in place instead of first gathering every pick's weights
    (Mixtral-8x7B's two picks: 672 MiB of bf16 per layer call). A slab's slots are equally
    shaped and strided, so each pick's GEMM reads the operand layout a gathered copy has."""
    if not 1 <= len(slots) <= 2 or (len(slots) == 2 and slots[1] <= slots[0]):
        return None
    out = SlotExperts.__new__(SlotExperts)
    out.__dict__.update(px.__dict__)
    lo, step = slots[0], (slots[-1] - slots[0]) or 1
    names = ("gate_up_proj" if px.has_gate else "up_proj", "down_proj")
    for name in names + tuple(n + "_bias" for n in names if px.has_bias):
        slab = getattr(px, name)
        view = slab.as_strided((len(slots), *slab.shape[1:]), (step * slab.stride(0), *slab.stride()[1:]),
                               slab.storage_offset() + lo * slab.stride(0))
        setattr(out, name, _Picked(view))
    return out


@functools.lru_cache(maxsize=None)
def _pick_ids(k: int) -> torch.Tensor:
    """The ids a ``picked`` forward is called with: only their shape ([1, k]) is read."""
    return torch.empty((1, k), dtype=torch.int64, device="meta")


def batched_picks(px: SlotExperts, uploads: Uploads, hidden_states: torch.Tensor, top_k_weights: torch.Tensor,
                  slots: list[int], k: int, wait: Callable[[], None]) -> torch.Tensor:
    """transformers' batched_mm forward (its decode kernels on a GPU) with each pick's slot as its
    expert id. One token's one or two picks skip the weights' gather: in ascending slot order
    (their weights swapped with them; a sum of two is the same either way) the forward runs on
    strided views of their slots (``picked``); ``wait`` as for ``grouped_picks``."""
    if hidden_states.shape[0] == 1:  # one token: its k picks
        swap = len(slots) == 2 and slots[1] < slots[0]
        view = picked(px, slots[::-1] if swap else slots)
        if view is not None:
            wait()
            return batched_mm_experts_forward(view, hidden_states, _pick_ids(k), top_k_weights.flip(-1) if swap else top_k_weights)
    ids = uploads.ints(slots, dtype=torch.int64).view(-1, k)  # [T, k] slots
    wait()
    return batched_mm_experts_forward(px, hidden_states, ids, top_k_weights)
