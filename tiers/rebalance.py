"""Rolling routing statistics and the background rebalancer of the hot set, the cpu pool and nvme.

Owns: per-expert lookup counts over a rolling window of tokens (``RoutingWindow``), the pure plan
of which experts change tier (``plan_moves``), and carrying a plan out on the tier manager
(``Rebalancer``) without stalling the compute stream:

- to hot: the newcomer's packed blob (gpu precision) is read on a rebalance thread into a pinned
  promotion buffer, and the outgoing expert's cpu blob into a spare warm place. Once both have
  landed and nobody holds the outgoing expert's hot slot, the copy stream waits on an event
  recorded on the compute stream (kernels already queued may still read the slot), the outgoing
  expert becomes warm at the spare place (never a disk read on the serving path), and the
  newcomer is copied into the same slot, so slot addresses never change. The newcomer's old warm
  place becomes the spare; a newcomer from disk instead cools the least used warm expert, whose
  place becomes the spare, so the warm set keeps its size;
- to warm: the host bytes of the outgoing warm expert (or a free place) are taken first (the
  outgoing expert lives on disk again), then the thread waits for every copy queued so far on
  the copy stream (one may read those bytes) and reads the newcomer's blob into them; it becomes
  warm only when its read has landed.

Invariants: no bytes are overwritten while a queued copy or kernel may read them; every expert
always has a home it can be served from (nvme until its new bytes have landed); the hot set
keeps its slot count and the warm set its places, so both budgets hold; layers whose experts are
all hot (served through static maps, without routing on the host) are left alone.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiers import quant
from tiers.loader.layout import ExpertGrid, ExpertKey
from tiers.config import Rebalance
from tiers.disk_store import IntegrityError
from tiers.residency import Home, Op


class RoutingWindow:
    """Lookups per expert over the last ``window`` intervals of ``every_tokens`` tokens, as arrays
    over an ``ExpertGrid``.

    The closed intervals still in the window are kept summed (``closed``): an interval adds its
    counts once when it closes and takes them back once when it falls out, so what a rebalance
    costs the serving thread does not grow with ``window``."""

    def __init__(self, grid: ExpertGrid, every_tokens: int, window: int):
        self.grid = grid
        self.every = every_tokens
        self.intervals: deque[np.ndarray] = deque([np.zeros(grid.size, dtype=np.int64)], maxlen=window)
        self.spans: deque[int] = deque([0], maxlen=window)  # tokens counted in each interval (a long call overfills one)
        self.closed = np.zeros(grid.size, dtype=np.int64)  # the sum of every interval but the open one (the last)
        self.tokens = 0

    def count(self, keys: Iterable[ExpertKey]) -> None:
        """One lookup of each of ``keys`` (repeats count again)."""
        idx = [self.grid.index(k) for k in keys]
        if idx:
            np.add.at(self.intervals[-1], idx, 1)

    def add(self, counts: np.ndarray) -> None:
        """Lookups counted elsewhere (direct decode's, on the device), [grid.size]."""
        self.intervals[-1] += counts

    def frequency(self) -> np.ndarray:
        return self.closed + self.intervals[-1]

    def add_tokens(self, n: int) -> np.ndarray | None:
        """Count ``n`` tokens. When that closes an interval: the window's frequency (and a new
        interval opens, the oldest dropping out); otherwise None."""
        self.tokens += n
        self.spans[-1] += n
        if self.tokens < self.every:
            return None
        self.tokens = 0
        freq = self.frequency()
        self.closed += self.intervals[-1]
        if len(self.intervals) == self.intervals.maxlen:  # the oldest falls out as the new one opens
            self.closed -= self.intervals[0]
        self.intervals.append(np.zeros(self.grid.size, dtype=np.int64))
        self.spans.append(0)
        return freq


@dataclass(frozen=True)
class Move:
    key: ExpertKey
    to: Home  # GPU (hot) or CPU (warm)
    replaces: ExpertKey | None  # the expert whose hot slot or host bytes it takes; None: a free place


@dataclass(frozen=True, eq=False)
class GroupState:
    """One slot pool's experts as the planner sees them: bool masks over ``grid``."""

    grid: ExpertGrid
    keys: np.ndarray  # every expert the rebalancer may move (static layers excluded)
    hot: np.ndarray
    warm: np.ndarray
    free_places: int  # warm places nobody holds
    busy: np.ndarray | None = None  # in flight or held: not moved this time (None: none)

    @classmethod
    def of(cls, grid: ExpertGrid, keys: Iterable[ExpertKey], hot: Iterable[ExpertKey], warm: Iterable[ExpertKey],
           free_places: int, busy: Iterable[ExpertKey] = ()) -> GroupState:
        """The masks of sets of keys."""
        return cls(grid, grid.mask(keys), grid.mask(hot), grid.mask(warm), free_places, grid.mask(busy))


def _better(new: float, old: float, margin: float, significance: float = 0.0) -> bool:
    """``new`` uses beat ``old`` by ``margin`` of ``old``, by one at least, and by ``significance``
    standard deviations of the difference of two Poisson counts with those means."""
    new, old = float(new), float(old)
    return new > old * (1.0 + margin) and new >= old + 1 and new - old >= significance * math.sqrt(new + old)


def _least(freq: np.ndarray, mask: np.ndarray, n: int, offset: int = 0) -> list[int]:
    """The ``n`` least used cells of ``mask``, ascending by (uses, cell), as cells + ``offset``."""
    if n <= 0:
        return []
    idx = np.flatnonzero(mask)
    if len(idx) > 4 * n:  # keep the n smallest uses (ties at the cut included) before sorting
        cut = np.partition(freq[idx], n - 1)[n - 1]
        idx = idx[freq[idx] <= cut]
    return (idx[np.lexsort((idx, freq[idx]))][:n] + offset).tolist()


def plan_moves(freq: np.ndarray, group: GroupState, *, max_moves: int, margin: float, significance: float = 0.0,
               across_layers: bool = False) -> list[Move]:
    """Promote the most used experts into the hot set and the warm pool, replacing the least used,
    a newcomer only when used ``margin`` more often than what it replaces and ``significance``
    standard deviations more (``_better``: no churn on noise). ``freq``: uses per cell of
    ``group.grid``.
    At most ``max_moves`` moves per tier. Ties break by key, so a plan is deterministic.

    A hot newcomer replaces a hot expert of its own layer (``across_layers`` False, the default):
    it takes its victim's hot slot, so every layer keeps its hot count and the run of slots it was
    loaded into. With ``across_layers`` it replaces the least used hot expert of any layer, one of
    its own on a tie, and capacity moves to the layers whose experts are used more; each such
    move leaves a slot of the newcomer's layer inside another layer's run, and the demoted
    expert's host place (it takes the newcomer's, ``_relocate``) inside another layer's run of
    warm places. Why own-layer by default: a whole-layer call runs one grouped GEMM per run of its
    layer's hot slots and copies each run of its warm places apart. On the bench's skewed trace
    (``bench/results/hot_layout-qwen3_moe-across.json``: CPU, Qwen3's 12 layers of 128 experts,
    28 generates of 33 tokens, rebalancing every 8) moves across layers left 6-11 and 8-16 runs
    of hot slots per layer at 25% and 50% and 14-31 runs of warm places, and a 2048-token
    forward's parts made 307 and 357 copies against 87 and 61; own-layer moves kept one run of
    each per layer, with GPU hit rates within 0.002 of the others' in every block of four
    generates (0.82 and 0.92 in the last). Among the least used hot experts of all layers, ties
    broken by key alone took the lowest layers' experts (layer 0's 60 hot experts of 128 became
    16), hence the own layer first on a tie there.

    Only used experts can be newcomers (a move needs one use more than what it replaces), and at
    most ``max_moves`` experts are replaced per tier, so the plan sorts the used experts and picks
    the least used hot and warm ones without sorting the group. The grid's cell order is the
    keys' order, so every tie breaks as it would by key; the plan is a few vector operations over
    the grid (Qwen3-30B-A3B's 6144 experts in 48 layers), not a loop over keys."""
    grid = group.grid
    busy = group.busy if group.busy is not None else np.zeros(grid.size, dtype=bool)
    # the used experts that are neither hot nor busy, most used first: the newcomers to choose from
    idx = np.flatnonzero((freq > 0) & group.keys & ~group.hot & ~busy)
    used = idx[np.lexsort((idx, -freq[idx]))]
    if across_layers:
        hot_pairs = _hot_moves(freq, group, busy, used[:max_moves].tolist(), max_moves, margin, significance)
    else:
        hot_pairs = _own_layer_hot_moves(freq, group, busy, used, max_moves, margin, significance)
    promoted = {new for new, _ in hot_pairs}
    free = min(group.free_places, max_moves)  # places freed by promotions from warm only free up when those land
    # Experts hot now stay out even when demoted by this plan: they are hot until their swap lands.
    rest = used[~group.warm[used]][: free + max_moves + len(promoted)]
    candidates = [i for i in rest.tolist() if i not in promoted][: free + max_moves]
    warm_pairs: list[tuple[int, int | None]] = [(new, None) for new in candidates[:free]]
    unpromoted = group.warm & ~busy
    unpromoted[list(promoted)] = False
    for new, old in zip(candidates[len(warm_pairs):], _least(freq, unpromoted, max_moves - len(warm_pairs))):
        if len(warm_pairs) >= max_moves or not _better(freq[new], freq[old], margin, significance):
            break
        warm_pairs.append((new, old))
    key = grid.key
    return ([Move(key(new), Home.GPU, key(old)) for new, old in hot_pairs]
            + [Move(key(new), Home.CPU, None if old is None else key(old)) for new, old in warm_pairs])


def _hot_moves(freq: np.ndarray, group: GroupState, busy: np.ndarray, newcomers: list[int], max_moves: int, margin: float,
               significance: float) -> list[tuple[int, int]]:
    """Each newcomer (most used first) replaces the least used hot expert left, by (uses, not of
    the newcomer's layer, key), while it is better (``_better``: margin and significance): the
    (newcomer, victim) cells. The victims' uses never decrease and the newcomers' never increase,
    so the first failure ends the plan. The least ``max_moves`` of the group and of each
    newcomer's layer hold every victim the rule can pick."""
    w = group.grid.width
    movable = group.hot & ~busy
    least = _least(freq, movable, max_moves)
    local = {r: _least(freq[r * w:(r + 1) * w], movable[r * w:(r + 1) * w], max_moves, r * w) for r in {new // w for new in newcomers}}
    taken: set[int] = set()
    pairs: list[tuple[int, int]] = []
    for new in newcomers:
        overall = next((k for k in least if k not in taken), None)
        own = next((k for k in local[new // w] if k not in taken), None)
        left = [k for k in (overall, own) if k is not None]
        if not left:
            break
        old = min(left, key=lambda k: (freq[k], k // w != new // w, k))
        if not _better(freq[new], freq[old], margin, significance):
            break
        pairs.append((new, old))
        taken.add(old)
    return pairs


def _own_layer_hot_moves(freq: np.ndarray, group: GroupState, busy: np.ndarray, used: np.ndarray, max_moves: int,
                         margin: float, significance: float) -> list[tuple[int, int]]:
    """Each newcomer (``used``: most used first) replaces the least used hot expert of its own
    layer left, by (uses, key), while it is better: the (newcomer, victim) cells, ``max_moves`` at
    most. A layer's newcomers and victims are ordered as in ``_hot_moves``, so a layer's first
    failure ends that layer's moves, not the others': a layer whose best newcomer cannot beat its
    own victims must not starve the rest. Only each layer's ``max_moves`` most used newcomers can
    move, and only layers whose best newcomer beats their least used hot expert are visited."""
    if not len(used):
        return []
    w = group.grid.width
    movable = group.hot & ~busy
    rows = used // w
    by_row = np.argsort(rows, kind="stable")  # each layer's newcomers, most used first
    first = np.searchsorted(rows[by_row], rows[by_row])
    rank = np.empty(len(used), dtype=np.int64)
    rank[by_row] = np.arange(len(used)) - first
    keep = rank < max_moves
    used, rows, leaders = used[keep], rows[keep], used[rank == 0]
    least = np.where(movable, freq, np.inf).reshape(-1, w).min(axis=1)  # per layer: its least used movable hot expert
    live = {int(new // w) for new in leaders if _better(freq[new], least[new // w], margin, significance)}
    victims: dict[int, list[int]] = {}
    pairs: list[tuple[int, int]] = []
    for new, r in zip(used.tolist(), rows.tolist()):
        if len(pairs) >= max_moves or not live:
            break
        if r not in live:
            continue
        if r not in victims:
            victims[r] = _least(freq[r * w:(r + 1) * w], movable[r * w:(r + 1) * w], max_moves, r * w)
        if not victims[r] or not _better(freq[new], freq[victims[r][0]], margin, significance):
            live.discard(r)
            continue
        pairs.append((new, victims[r].pop(0)))
    return pairs


@dataclass
class _HotRead:
    future: Future  # the newcomer's gpu blob -> promotion buffer
    buffer: int
    replaces: ExpertKey
    spare: int  # host offset the outgoing expert's cpu blob is read into
    out_future: Future


class Rebalancer:
    """Carries plans out on a ``TierManager`` (duck-typed: its table, pools, host pool, disk,
    streams and staging helpers). Called on the serving thread only; reads run on its own thread."""

    # Pinned promotion buffers (hot promotions in flight at once), each with a spare warm place
    # per pool: as many as fit PROMOTION_BYTES, at least MIN_BUFFERS, at most max_moves.
    # Why: a rebalance promotes at most one expert per free buffer, so with two the hot set of the
    # bench's skewed trace was still climbing after 800 tokens (every 8 tokens, Qwen3's counts on
    # the CPU: bench/hot_converge.py, bench/results/hot_converge-qwen3_moe-*.json); small experts
    # cost little to buffer, large ones (Mixtral-8x7B: 336 MiB in bf16) keep two.
    MIN_BUFFERS = 2
    PROMOTION_BYTES = 64 << 20

    @classmethod
    def buffer_count(cls, manifest: Any, cfg: Any) -> int:
        """How many promotion buffers (and spares per pool) a manager with ``cfg`` holds."""
        fit = cls.PROMOTION_BYTES // max(1, cls.largest_blob(manifest, cfg.gpu.precision, manifest.layers))
        return max(cls.MIN_BUFFERS, min(cfg.rebalance.max_moves, fit))

    @classmethod
    def buffer_bytes(cls, manifest: Any, cfg: Any, placement: Any) -> int:
        """Host bytes for the promotion buffers. Hot slots are refilled straight from them, so a
        lossy gpu precision (which would need a transit buffer of its own) keeps the hot set as
        loaded: 0, as without hot experts."""
        gp, cp = cfg.gpu.precision, cfg.cpu.precision
        if not cfg.rebalance.every_tokens or not placement.hot or not quant.get_scheme(gp).lossless:
            return 0
        n = cls.buffer_count(manifest, cfg)
        return n * cls.largest_blob(manifest, gp, manifest.layers) + n * sum(cls.largest_blob(manifest, cp, g.layers) for g in placement.groups)

    @staticmethod
    def largest_blob(manifest: Any, precision: str, layers: Iterable[int]) -> int:
        """Bytes of the largest ``precision`` blob among ``layers``: one promotion buffer or spare place."""
        return max(manifest.layers[L].blobs[precision].stride for L in layers)

    def __init__(self, mgr: Any, cfg: Rebalance, *, threads: int):
        self.mgr, self.cfg = mgr, cfg
        self.grid = mgr.table.grid
        self.window = RoutingWindow(self.grid, cfg.every_tokens, cfg.window)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tiers-rebalance") if threads else None
        self.hot_moves = self.buffer_bytes(mgr.manifest, mgr.cfg, mgr.placement) > 0
        self.buffers, self.spares = [], {id(p): [] for p in mgr.pools}  # spares: per pool, free warm places for demotions
        if self.hot_moves:
            size = self.largest_blob(mgr.manifest, mgr.cfg.gpu.precision, mgr.manifest.layers)
            n = self.buffer_count(mgr.manifest, mgr.cfg)
            self.buffers = [mgr.host.view(mgr.host.alloc(size), size) for _ in range(n)]
            for p in mgr.pools:
                place = self.largest_blob(mgr.manifest, mgr.cfg.cpu.precision, {k.layer for k in mgr.keys_of[id(p)]})
                self.spares[id(p)] = [mgr.host.alloc(place) for _ in range(n)]
        self.buffer_busy: list[Any | None] = [None] * len(self.buffers)
        self.hot_reads: dict[ExpertKey, _HotRead] = {}
        self.warm_reads: dict[ExpertKey, tuple[Future, int]] = {}
        # demoted experts being copied from the spare place they were read into to the place their
        # promoted counterpart left: expert -> (copy, spare place, that place)
        self.relocations: dict[ExpertKey, tuple[Future, int, int]] = {}
        self.free_places: dict[int, list[int]] = {id(p): [] for p in mgr.pools}
        self.counts = {"rebalances": 0, "promoted_hot": 0, "promoted_warm": 0, "read_errors": 0}
        # per pool: its experts, and those the rebalancer may move (the static layers are fixed at load)
        self._pool_mask = {id(p): self.grid.mask(mgr.keys_of[id(p)]) for p in mgr.pools}
        self._movable_mask = {id(p): self.grid.mask(k for k in mgr.keys_of[id(p)] if self.movable(k.layer)) for p in mgr.pools}

    # -- accounting ---------------------------------------------------------------------------
    def movable(self, layer: int) -> bool:
        return layer not in self.mgr.static_maps

    def note_call(self, layer: int, keys: list[ExpertKey], tokens: int, first: bool) -> None:
        """A layer call begins: count its lookups. At the first layer, land whatever has finished,
        count the tokens, and when an interval closes plan and issue a rebalance. Swaps land only
        there, between two layer calls, never inside one. A whole-layer call is noted when it is
        counted (``settle``): after the last pooled layer's whole-layer call of a later forward
        (``settle_after``) or at the next call that waits for its routing, whichever comes first;
        only once ``UNSETTLED_CALLS`` wait (a model whose last layer's calls are not whole-layer
        ones), at a whole-layer call's start, which can be inside a forward: its swaps and the
        fences of the reads it issues then fall inside that forward."""
        if not self.movable(layer):
            return
        if first:
            self.land()
            if self.window.tokens + tokens >= self.window.every:  # the interval closes
                self._count_direct()
            freq = self.window.add_tokens(tokens)
            if freq is not None:
                self.rebalance(freq)
        if keys:
            self.window.count(keys)

    def _count_direct(self) -> None:
        """Add direct decode's device counts since the last take (one sync, only if a direct call ran)."""
        usage = self.mgr.take_direct_usage()
        if usage is not None:
            self.window.add(usage)

    # -- planning -----------------------------------------------------------------------------
    def rebalance(self, freq: np.ndarray) -> list[Move]:
        """Plan and issue moves by ``freq``, uses per cell of the table's grid."""
        mgr = self.mgr
        self.counts["rebalances"] += 1
        busy = self._busy()
        issued = []
        for pool in mgr.pools:
            keys = self._movable_mask[id(pool)]
            state = GroupState(
                grid=self.grid,
                keys=keys,
                hot=keys & mgr.table.hot_mask,
                warm=keys & mgr.table.warm_mask,
                free_places=len(self.free_places[id(pool)]),
                busy=busy,
            )
            for move in plan_moves(freq, state, max_moves=self.cfg.max_moves, margin=self.cfg.margin,
                                   significance=self.cfg.significance, across_layers=self.cfg.across_layers):
                if self._issue(move, pool):
                    issued.append(move)
        return issued

    def _busy(self) -> np.ndarray:
        """Experts a move may not touch now (a mask over the grid): those with a rebalance read in
        flight, the hot experts promotions will replace, and those with a read-ahead in flight."""
        busy = set(self.hot_reads) | set(self.warm_reads) | set(self.relocations) | {r.replaces for r in self.hot_reads.values()}
        return self.grid.mask(busy | {v[1] for v in self.mgr.pending.values()})

    def _issue(self, move: Move, pool: Any) -> bool:
        mgr = self.mgr
        if move.to is Home.GPU:
            if not self.hot_moves:
                return False
            # a buffer is free once no read fills it and its last promotion's copy up has read it;
            # a copy up still queued is not waited for (it is queued behind every copy before it,
            # a prefill's reads among them): the move waits for a later rebalance instead
            reading = {r.buffer for r in self.hot_reads.values()}
            free = [i for i in range(len(self.buffers))
                    if i not in reading and (self.buffer_busy[i] is None or self.buffer_busy[i].query())]
            spares = self.spares[id(pool)]
            if not free or not spares:
                return False
            i = free[0]
            self.buffer_busy[i] = None
            spare = spares.pop()
            out = self._read_into_place(move.replaces, spare)
            self.hot_reads[move.key] = _HotRead(self._submit(mgr.disk.read, move.key, mgr.cfg.gpu.precision, self.buffers[i]), i,
                                                move.replaces, spare, out)
            return True
        if move.replaces is not None:
            r = mgr.table[move.replaces]
            if r.home is not Home.CPU:
                return False
            offset = r.host_offset
            mgr.table.apply(move.replaces, Op.COOL)  # from now on it is served from disk
        elif self.free_places[id(pool)]:
            offset = self.free_places[id(pool)].pop()
        else:
            return False
        self.warm_reads[move.key] = (self._read_into_place(move.key, offset), offset)
        return True

    def _read_into_place(self, key: ExpertKey, offset: int) -> Future:
        """Read ``key``'s cpu blob into the host pool at ``offset`` on a rebalance thread, once every
        read of host memory queued so far is done: the copy stream's copies and direct stacks, and
        the compute stream's direct decode kernels (one may still read the old bytes there)."""
        mgr = self.mgr
        cp = mgr.cfg.cpu.precision
        return self._submit(self._read_after, self._host_fence(), key, cp, mgr.host.view(offset, mgr.manifest.ref(key, cp).nbytes))

    def _host_fence(self) -> Any:
        """An event past every read of host memory queued so far: the copy stream's copies and
        direct stacks, and (the copy stream made to wait for it) the compute stream's direct decode
        kernels."""
        mgr = self.mgr
        compute = mgr.streams.event()
        compute.record(mgr.streams.current())
        mgr.copy_stream.wait_event(compute)
        # Waited for on a rebalance thread, behind a prefill's reads at times: a blocking event,
        # so that thread sleeps. On the H200 a default event's wait spun 84-87% of a core for as
        # long as it waited, a blocking one's 1% (bench/results/spin_probe.json).
        fence = mgr.streams.event(blocking=True)
        fence.record(mgr.copy_stream)
        return fence

    def _relocate(self, key: ExpertKey, spare: int, place: int) -> None:
        """Copy warm ``key``'s blob from ``spare`` to ``place`` on a rebalance thread, once nothing
        reads ``place`` any more; it moves there when the copy is landed. A layer's warm experts
        were placed side by side at load, and a streamed part copies each run of them that lies
        back to back with one copy: were every demoted expert left in the spare it was read into,
        each swap would split two runs (a model of 12 layers of 128 experts went from one run
        per layer to 15-31 after 156 swaps, ``bench/hot_layout.py``)."""
        mgr = self.mgr
        nbytes = mgr.manifest.ref(key, mgr.cfg.cpu.precision).nbytes
        copy = self._submit(self._copy_after, self._host_fence(), mgr.host.view(spare, nbytes), mgr.host.view(place, nbytes))
        self.relocations[key] = (copy, spare, place)

    @staticmethod
    def _copy_after(fence: Any, src, dst) -> None:
        fence.synchronize()
        dst.copy_(src)

    def _submit(self, fn, *args) -> Future:
        if self.pool is not None:
            return self.pool.submit(fn, *args)
        f: Future = Future()  # no threads: read on the serving thread
        try:
            f.set_result(fn(*args))
        except Exception as e:  # surfaces when the read is landed
            f.set_exception(e)
        return f

    def _read_after(self, fence: Any, key: ExpertKey, precision: str, dst) -> None:
        fence.synchronize()
        self.mgr.disk.read(key, precision, dst)

    # -- landing ------------------------------------------------------------------------------
    def land(self, wait: bool = False) -> None:
        """Finish every read that has landed (all of them, waiting, with ``wait``)."""
        for key, (future, offset) in list(self.warm_reads.items()):
            if wait or future.done():
                del self.warm_reads[key]
                self._finish_warm(key, future, offset)
        for key, read in list(self.hot_reads.items()):
            if wait or (read.future.done() and read.out_future.done()):
                if self._finish_hot(key, read):
                    del self.hot_reads[key]
        for key, (copy, spare, place) in list(self.relocations.items()):
            if wait or copy.done():
                del self.relocations[key]
                self._finish_relocation(key, copy, spare, place)

    def _finish_relocation(self, key: ExpertKey, copy: Future, spare: int, place: int) -> None:
        """``key`` moves to ``place`` and its spare is free again (reads of it still queued land
        first: a spare is only read into after a fence); if the copy failed it stays, and
        ``place`` becomes the spare. The expert was busy meanwhile, so it is still warm in the spare."""
        mgr = self.mgr
        spares = self.spares[id(mgr.pool_of[key.layer])]
        if copy.exception() is not None:
            spares.append(place)
            return
        mgr.table.apply(key, Op.MOVE, offset=place)
        spares.append(spare)

    def _finish_warm(self, key: ExpertKey, future: Future, offset: int) -> None:
        mgr = self.mgr
        places = self.free_places[id(mgr.pool_of[key.layer])]
        try:
            future.result()
        except IntegrityError:
            self.counts["read_errors"] += 1
            places.append(offset)
            return
        r = mgr.table[key]
        if r.pinned or r.home is not Home.NVME:  # promoted to hot meanwhile: the place stays free
            places.append(offset)
            return
        mgr.table.apply(key, Op.WARM, offset=offset)
        self.counts["promoted_warm"] += 1

    def _finish_hot(self, key: ExpertKey, read: _HotRead) -> bool:
        """Swap ``key`` into the hot slot of ``read.replaces``. False: retry later (held now)."""
        mgr = self.mgr
        pool = mgr.pool_of[key.layer]
        spares = self.spares[id(pool)]
        try:
            read.future.result()
        except IntegrityError:
            read.out_future.exception()  # let the other read finish before its place is reused
            self.counts["read_errors"] += 1
            spares.append(read.spare)
            return True
        out_ok = read.out_future.exception() is None
        slot = mgr.table[read.replaces].slot
        if pool.readers[slot] > 0:
            return False
        r = mgr.table[key]
        if r.slot is not None:  # cached in a staging slot (or still loading into one): give it up
            if (id(pool), r.slot) in mgr.pending:
                mgr._complete((id(pool), r.slot))
            if pool.readers[r.slot] > 0:
                return False
            mgr.drop_staged(pool, r.slot)
            r = mgr.table[key]
        freed = r.host_offset
        fork = mgr.streams.event()
        fork.record(mgr.streams.current())  # kernels queued so far may still read the outgoing expert
        mgr.copy_stream.wait_event(fork)
        mgr.table.apply(read.replaces, Op.DEMOTE)
        if out_ok:  # its cpu blob is in place already: it is served from the host pool from now on
            mgr.table.apply(read.replaces, Op.WARM, offset=read.spare)
        else:
            self.counts["read_errors"] += 1
            spares.append(read.spare)
        mgr.table.apply(key, Op.PROMOTE, slot)
        gp = mgr.cfg.gpu.precision
        src = self.buffers[read.buffer][: mgr.manifest.ref(key, gp).nbytes]
        busy = mgr._stage(key, pool, slot, gp, "rebalance", src)
        assert busy is not None, "swaps land between layer calls, outside a staging batch"
        self.buffer_busy[read.buffer] = busy
        if freed is not None:
            if out_ok:  # the demoted expert takes the place the promoted one left
                self._relocate(read.replaces, read.spare, freed)
            else:
                spares.append(freed)
        elif out_ok:  # the warm set grew by one: cool its least used expert to keep the cpu budget
            warm = _least(self.window.frequency(), mgr.table.warm_mask & self._pool_mask[id(pool)] & ~self._busy(), 1)
            if warm:
                coldest = self.grid.key(warm[0])
                spares.append(mgr.table[coldest].host_offset)
                mgr.table.apply(coldest, Op.COOL)
        self.counts["promoted_hot"] += 1
        return True

    def routing_counts(self) -> tuple[dict[int, list[int]], int]:
        """Lookups per expert over the window so far (direct decode's device counts taken in), per
        layer the rebalancer counts (static layers are not counted), and the tokens they span."""
        self._count_direct()
        freq, g = self.window.frequency(), self.grid
        layers = [L for L in g.layers if self.movable(L)]
        counts = {L: freq[g.row[L] * g.width : g.row[L] * g.width + g.experts[L]].tolist() for L in layers}
        return counts, sum(self.window.spans)

    def report(self) -> dict[str, int]:
        return dict(self.counts) | {"in_flight": len(self.hot_reads) + len(self.warm_reads)}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None  # what landing still queues (a relocation) runs here
        self.land(wait=True)
