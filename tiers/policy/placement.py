"""Placement: which experts are hot, warm or cold at load, and how many GPU slots each pool has.

Owns: turning the YAML sizes into counts against the packed checkpoint (with the errors that
need it: a budget smaller than one expert, a precision that was not packed), the preference
order (a routing file's counts when the load names one, else the manifest's routing prior when
present, else round-robin over layers so every layer gets an equal share), and the number of
staging slots. Routing documents themselves (files and priors) are ``loader.routing``'s.

Budget accounting on the GPU: ``budget >= hot slots + staging slots + transit rows``, all in
bytes: a transit row per staging slot where lossy experts are small enough to stack
(``STACK_BYTES``), else ``TRANSIT_RING`` rows at most; when every expert fits, no staging slot is
reserved. A gpu ``fraction`` is of the bytes of all experts at compute precision (bf16); a cpu
``fraction`` is of the bytes of all experts at the cpu tier's precision (4 KiB aligned blobs, each
in the encoding pack stored it in: an expert kept at int8 by ``--min-sqnr`` counts as int8).

Quantized hot experts (``tiers.gpu.precision`` not bf16): the budget holds the staging slots as
above and, in what is left, the hot experts' blobs in the gpu precision (``Placement.gpu_pool``,
counted at their 4 KiB aligned size), so it holds about 16 / bits-per-weight times as many; no
slot is hot, and every call that uses one dequantizes it into a staging slot. The rebalancer
does not move them yet: a config that asks for both is refused.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tiers import quant
from tiers.loader.layout import ExpertKey
from tiers.loader.pack_files import read_owned
from tiers.loader.packed import Manifest
from tiers.config import TiersConfig


@dataclass(frozen=True)
class GroupPlan:
    """Slots for layers sharing one expert signature."""

    layers: tuple[int, ...]
    slot_bytes: int
    transit_bytes: int
    hot: int
    staging: int
    transit_rows: int  # rows of transit_bytes the lossy copies land in, a ring (see STACK_BYTES)

    @property
    def n_slots(self) -> int:
        return self.hot + self.staging


@dataclass(frozen=True)
class Placement:
    hot: tuple[ExpertKey, ...]
    warm: tuple[ExpertKey, ...]
    cold: tuple[ExpertKey, ...]
    groups: tuple[GroupPlan, ...]
    gpu_budget: int
    cpu_budget: int
    gpu_pool: tuple[ExpertKey, ...] = ()  # quantized hot experts: blobs of the gpu precision kept on the GPU
    gpu_pool_bytes: int = 0

    @property
    def gpu_bytes(self) -> int:
        """Slot memory, transit buffers and the quantized hot experts' blobs: what the gpu budget bounds."""
        return sum(g.n_slots * g.slot_bytes + g.transit_rows * g.transit_bytes for g in self.groups) + self.gpu_pool_bytes


def preference_order(manifest: Manifest, routing: Mapping[int, Sequence[float]] | None = None) -> list[ExpertKey]:
    """Most valuable first: by ``routing`` (counts per layer, from ``loader.routing.read_routing``)
    if given, else by the manifest's routing prior if it has one (counts of the same kind), else
    round-robin over layers.

    Counts rank by each expert's share of its layer's lookups: every layer routes the same tokens,
    so shares compare across layers, and a layer the counts leave out (all its experts were hot,
    or it was not counted) ranks as if routed evenly."""
    keys = manifest.keys
    if routing is None:
        routing = manifest.routing_prior
    if routing is not None:
        share = {}
        for L, entry in manifest.layers.items():
            row = routing.get(L)
            total = sum(row) if row is not None else 0
            n = entry.layout.num_experts
            for e in range(n):
                share[(L, e)] = row[e] / total if total > 0 else 1.0 / n
        return sorted(keys, key=lambda k: (-share[(k.layer, k.expert)], k.expert, k.layer))
    return sorted(keys, key=lambda k: (k.expert, k.layer))


def _check_precision(manifest: Manifest, key: str, precision: str) -> None:
    if precision not in manifest.precisions:
        raise ValueError(
            f"{key}: precision {precision!r} was not packed in {str(manifest.root)!r} (packed: {list(manifest.precisions)}); "
            f"re-pack with `--config` naming this YAML, or choose a packed precision"
        )


AUTO_STAGING_PER_TOP_K = 2  # staging_slots: auto -> this many slots per routed expert of a token
# ... or more, up to twice as many, so that half of them (a streamed part) carries this many bytes
# up: on the H200, a Qwen3-30B-A3B prefill in INT8 parts of 8 experts (38 MB) left the copy engine
# idle 1.0 ms per layer behind the host, in parts of 16 for 0.01 ms (experiments/results/prefill_split-*-whole32.json)
AUTO_PART_BYTES = 64 << 20
# Lossy experts at most this large in transfer form are dequantized in stacks, a stack's copies
# landing in consecutive transit rows (so a pool keeps a row per staging slot); larger ones go up
# and are dequantized one at a time, each dequantization overlapping the next copy, through a
# ring of TRANSIT_RING rows: a copy into a row waits for the dequantization two back, which ends
# long before (Mixtral-8x7B on the H200: 0.75 ms to dequantize an expert, 3.2 ms to copy it up).
# The rows a ring saves hold more slots: at 25% of Mixtral-8x7B's experts, 4 staging slots with
# 4 rows left room for 9 hot experts, with 2 rows for 10 (replayed on the bench's skewed trace,
# 0.493 of the lookups hit the GPU against 0.466: experiments/results/cache_bound-mixtral-splits.json; on the H200,
# run 41's INT8 arms moved 1-7% fewer bytes per decoded token than run 40's), and auto staging
# takes them for staging slots instead (AUTO_RING_PER_TOP_K: 8 hot and 6 staging).
STACK_BYTES = 32 << 20
TRANSIT_RING = 2
# staging_slots: auto -> at least this many slots per routed expert of a token where every pool
# keeps a transit ring, its experts too large to stack. There a staging slot costs what a hot
# one does, and on routing that reuses experts from token to token a staging slot (which follows
# it) is worth more than a hot one (which holds its expert whatever the last tokens used): with
# Mixtral-8x7B's counts, replayed on the bench's skewed trace, 8 hot and 6 staging slots hit
# 0.529 of the lookups against 0.493 for 10 and 4, and 24 and 6 hit 0.839 against 0.808 for 26
# and 4, and as much or more on uniform routing (experiments/results/cache_bound-mixtral-splits*.json). On the H200
# (bench-mixtral-staging6.md against run 41) the INT8 arms moved 1-10% fewer bytes per decoded
# token with 6 staging slots (each arm still at its bytes bound) and their 2048-token prefills
# took 2-7% longer (fewer hot experts, more bytes up).
AUTO_RING_PER_TOP_K = 3


def transit_rows(staging: int, lossy_nbytes: int) -> int:
    """Transit rows a slot pool keeps for ``staging`` slots whose largest lossy blob (transfer
    form) is ``lossy_nbytes`` bytes: one per slot where they stack, else a ring of ``TRANSIT_RING``."""
    return staging if lossy_nbytes <= STACK_BYTES else min(staging, TRANSIT_RING)


def top_k(manifest: Manifest) -> int:
    """Experts routed per token, from the packed ``config.json`` (1 when it does not say; at most a
    layer's experts: tiers.load refuses a config that says more), read as every carried file is: a
    regular file inside the pack, its bytes checked against the manifest (``IntegrityError`` naming
    it otherwise)."""
    return min(_config_top_k(manifest), max(e.layout.num_experts for e in manifest.layers.values()))


def _config_top_k(manifest: Manifest) -> int:
    if "config.json" not in manifest.carried:
        return 1
    try:
        cfg = json.loads(read_owned(manifest.root, "config.json", manifest.carried["config.json"], "carried file"))
    except (ValueError, RecursionError):  # not JSON: tiers.load refuses it, naming the file, when it builds the model
        return 1
    for d in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        if not isinstance(d, dict):
            continue
        k = d.get("num_experts_per_tok")
        if isinstance(k, int) and not isinstance(k, bool) and k > 0:
            return k
    return 1


def _fill(order: list[ExpertKey], cost: Callable[[ExpertKey], int], budget: int) -> list[ExpertKey]:
    """Take experts in preference order while each one's cost still fits the budget."""
    taken = []
    for k in order:
        c = cost(k)
        if c <= budget:
            taken.append(k)
            budget -= c
    return taken


class _Sizes:
    """What the GPU plan needs to know of a manifest under a config: groups of layers sharing one
    expert signature (one slot pool each), their slot bytes, and their lossy transfer forms."""

    def __init__(self, cfg: TiersConfig, manifest: Manifest):
        self.cfg, self.manifest = cfg, manifest
        self.slot_bytes = {L: e.layout.nbytes() for L, e in manifest.layers.items()}
        self.groups: dict[tuple, list[int]] = {}
        for L, entry in manifest.layers.items():
            self.groups.setdefault(entry.layout.signature, []).append(L)

    def lossy(self, L: int) -> list:
        """The layer's blobs that are dequantized through a transit row: the cpu and nvme tiers', and
        the gpu tier's where hot experts stay quantized, in every encoding its experts use for them."""
        entry, cfg = self.manifest.layers[L], self.cfg
        return [entry.blobs[enc] for p in (cfg.cpu.precision, cfg.nvme.precision, cfg.gpu.precision) if p in entry.blobs and p != "bf16"
                for enc in entry.encodings[p]]

    def transit(self, Ls: list[int]) -> int:
        """Bytes of a transit row for layers ``Ls`` (one pool): their largest lossy blob's stride (0: none
        lossy). Layers of one signature differ where pack kept different experts at a higher precision."""
        return max((b.stride for L in Ls for b in self.lossy(L)), default=0)

    def largest(self, Ls: list[int]) -> int:
        return max((b.nbytes for L in Ls for b in self.lossy(L)), default=0)

    def rows(self, Ls: list[int], staging: int) -> int:
        return transit_rows(staging, self.largest(Ls))

    def reserve(self, n: int) -> int:
        """GPU bytes ``n`` staging slots per group take, with their transit rows."""
        return sum(n * self.slot_bytes[Ls[0]] + self.rows(Ls, n) * self.transit(Ls) for Ls in self.groups.values())

    def pool_stride(self, key: ExpertKey) -> int:
        """Bytes expert ``key`` takes in the GPU's blob pool: its gpu-precision blob's stride (an
        expert pack kept at a higher precision takes more)."""
        return self.manifest.blob(key, self.cfg.gpu.precision).stride

    def auto_staging(self, budget: int) -> int:
        """``staging_slots: auto``: 2 x top-k (a decode call's misses fit half of them), or up to 4 x
        so that half of them carries AUTO_PART_BYTES up, at least AUTO_RING_PER_TOP_K x top-k where
        every pool keeps a transit ring; in at most half the budget. Where hot experts stay quantized
        (``gpu.precision`` not bf16) and fewer slots (one at least) leave room for every expert in
        the GPU's blob pool, that many: then no decode call misses, and int4 layers need no slot
        to decode (``quant.fused4``)."""
        k = top_k(self.manifest)
        moved = min(self.transit(Ls) or self.slot_bytes[Ls[0]] for Ls in self.groups.values())  # an expert's bytes up
        n = max(AUTO_STAGING_PER_TOP_K * k, min(2 * AUTO_STAGING_PER_TOP_K * k, 2 * -(-AUTO_PART_BYTES // moved)))
        if all(self.largest(Ls) > STACK_BYTES for Ls in self.groups.values()):  # transit rings: see AUTO_RING_PER_TOP_K
            n = max(n, AUTO_RING_PER_TOP_K * k)
        while n > 1 and self.reserve(n) > budget // 2:
            n -= 1
        if self.cfg.gpu.precision != "bf16":
            every = sum(self.pool_stride(key) for key in self.manifest.keys)
            fewer = n
            while fewer > 1 and self.reserve(fewer) + every > budget:
                fewer -= 1
            if self.reserve(fewer) + every <= budget:
                n = fewer
        return n


def _plan_gpu(sizes: _Sizes, order: list[ExpertKey], budget: int, budget_key: str) -> tuple[list[ExpertKey], int]:
    """The hot experts and the staging slots per pool under ``budget`` bytes of GPU memory."""
    if budget >= sum(sizes.slot_bytes[k.layer] for k in order):
        return list(order), 0  # every expert fits: no staging slot
    n_staging, reserved = _staging(sizes, budget, budget_key)
    return _fill(order, lambda k: sizes.slot_bytes[k.layer], budget - reserved), n_staging


def _plan_gpu_pool(sizes: _Sizes, order: list[ExpertKey], budget: int, budget_key: str) -> tuple[list[ExpertKey], int, int]:
    """Quantized hot experts: the staging slots per pool, and in the rest of ``budget`` the experts
    whose gpu-precision blobs fit; (those experts, the staging slots, their blobs' bytes)."""
    cfg = sizes.cfg
    if cfg.rebalance.every_tokens:
        raise ValueError(f"tiers.rebalance.every_tokens: the rebalancer moves bf16 hot experts, and with tiers.gpu.precision "
                         f"{cfg.gpu.precision!r} the hot experts stay quantized; set it to 0, or tiers.gpu.precision to bf16")
    n_staging, reserved = _staging(sizes, budget, budget_key)
    pool = _fill(order, sizes.pool_stride, budget - reserved)
    return pool, n_staging, sum(sizes.pool_stride(k) for k in pool)


def _staging(sizes: _Sizes, budget: int, budget_key: str) -> tuple[int, int]:
    """The staging slots per pool the config asks for (``auto``: ``_Sizes.auto_staging``) and the
    bytes they take with their transit rows, checked against ``budget``."""
    n_staging = sizes.cfg.gpu.staging_slots
    if n_staging == "auto":
        n_staging = sizes.auto_staging(budget)
    reserved = sizes.reserve(n_staging)
    smallest = min(sizes.slot_bytes.values())
    if budget < smallest:
        raise ValueError(
            f"{budget_key}: {budget} bytes is smaller than one expert ({smallest} bytes at bf16); "
            f"the gpu tier needs at least {reserved} bytes for {n_staging} staging slot(s)"
        )
    if budget < reserved:
        raise ValueError(
            f"{budget_key}: {budget} bytes cannot hold the {n_staging} staging slot(s) misses need "
            f"({reserved} bytes with transit buffers); raise it to at least {reserved} or lower tiers.gpu.staging_slots"
        )
    return n_staging, reserved


def _plan_cpu(cfg: TiersConfig, manifest: Manifest, order: list[ExpertKey], rest: list[ExpertKey]) -> tuple[list[ExpertKey], int]:
    """The warm experts among ``rest`` (in preference order) under the cpu tier's budget, and that budget."""
    csize = cfg.cpu.size
    cpu_key = "tiers.cpu.budget" if csize.budget is not None else "tiers.cpu.fraction"
    packed = cfg.cpu.precision in manifest.precisions

    def stride(k: ExpertKey) -> int:  # its blob's real size in the pool (the encoding pack kept it in)
        return manifest.blob(k, cfg.cpu.precision).stride if packed else 0

    if rest and (csize.budget or csize.fraction):
        _check_precision(manifest, "tiers.cpu.precision", cfg.cpu.precision)
    cpu_budget = csize.budget if csize.budget is not None else int(csize.fraction * sum(stride(k) for k in order))
    if not cpu_budget:  # no cpu tier (its precision unchecked, so possibly not packed: a stride of 0 would "fit" every expert)
        return [], 0
    if csize.budget is not None and rest and cpu_budget < min(stride(k) for k in rest):
        raise ValueError(
            f"{cpu_key}: {cpu_budget} bytes is smaller than one expert ({min(stride(k) for k in rest)} bytes at {cfg.cpu.precision})"
        )
    return _fill(rest, stride, cpu_budget), cpu_budget


def plan_placement(cfg: TiersConfig, manifest: Manifest, routing: Mapping[int, Sequence[float]] | None = None) -> Placement:
    """The hot, warm and cold sets and the slot plan: experts taken in ``preference_order`` (by
    ``routing``, when given) while each tier's budget holds."""
    order = preference_order(manifest, routing)
    sizes = _Sizes(cfg, manifest)
    size = cfg.gpu.size
    gpu_key = "tiers.gpu.budget" if size.budget is not None else "tiers.gpu.fraction"
    gpu_budget = size.budget if size.budget is not None else int(size.fraction * sum(sizes.slot_bytes[k.layer] for k in order))
    _check_precision(manifest, "tiers.gpu.precision", cfg.gpu.precision)
    pool, pool_bytes = [], 0
    if quant.get_scheme(cfg.gpu.precision).lossless:
        hot, n_staging = _plan_gpu(sizes, order, gpu_budget, gpu_key)
    else:
        hot, (pool, n_staging, pool_bytes) = [], _plan_gpu_pool(sizes, order, gpu_budget, gpu_key)
    hot_set = set(hot) | set(pool)
    rest = [k for k in order if k not in hot_set]
    warm, cpu_budget = _plan_cpu(cfg, manifest, order, rest)
    warm_set = set(warm)
    cold = [k for k in rest if k not in warm_set]
    if cold:
        _check_precision(manifest, "tiers.nvme.precision", cfg.nvme.precision)
    groups = tuple(
        GroupPlan(
            layers=tuple(Ls),
            slot_bytes=sizes.slot_bytes[Ls[0]],
            transit_bytes=sizes.transit(Ls) if n_staging else 0,
            hot=sum(1 for k in hot if k.layer in Ls),
            staging=n_staging,
            transit_rows=sizes.rows(Ls, n_staging),
        )
        for Ls in sizes.groups.values()
    )
    return Placement(tuple(sorted(hot)), tuple(sorted(warm)), tuple(sorted(cold)), groups, gpu_budget, cpu_budget,
                     tuple(sorted(pool)), pool_bytes)
