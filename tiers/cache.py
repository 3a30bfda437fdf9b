"""GPU expert cache over the staging slots: LRU or LFU with decay, and Belady's MIN to judge them.

Owns: which staging slot a miss takes. Hot slots are pinned and never offered. Policies see
only slots, keys and time counted in lookups (never a wall clock), so a replay of a recorded
routing trace is deterministic. Invariant: ``victim`` only returns a slot nobody holds
(``readers[slot] == 0``); an empty slot is always taken before an occupied one.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from loader.layout import ExpertKey

POLICIES = ("lru", "lfu")


class LruSlots:
    """Least recently used first."""

    def __init__(self, slots: Iterable[int]):
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(slots)
        self._owner: dict[int, ExpertKey] = {}

    def access(self, key: ExpertKey) -> None:  # LRU needs no per-key history
        pass

    def assign(self, slot: int, key: ExpertKey) -> None:
        self._owner[slot] = key
        self.touch(slot)

    def touch(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def victim(self, readers: Sequence[int]) -> int | None:
        """An empty slot if any, else the least recently used slot nobody holds; None if all are held."""
        free = [s for s in self._order if readers[s] == 0]
        for s in free:
            if s not in self._owner:
                return s
        return free[0] if free else None


class LfuSlots(LruSlots):
    """Least frequently used first, frequencies decaying by ``decay`` per lookup; LRU breaks ties.

    A key's score is the sum over its past lookups of ``decay ** age`` (age in lookups), kept as
    (score, time) and brought forward lazily, so each lookup costs O(1).
    """

    def __init__(self, slots: Iterable[int], decay: float = 0.99):
        super().__init__(slots)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"tiers.gpu.lfu_decay: must be in (0, 1], got {decay!r}")
        self.decay = decay
        self.now = 0
        self._score: dict[ExpertKey, tuple[float, int]] = {}

    def score(self, key: ExpertKey) -> float:
        s, t = self._score.get(key, (0.0, self.now))
        return s * self.decay ** (self.now - t)

    def access(self, key: ExpertKey) -> None:
        self.now += 1
        self._score[key] = (self.score(key) + 1.0, self.now)

    def victim(self, readers: Sequence[int]) -> int | None:
        free = [s for s in self._order if readers[s] == 0]
        for s in free:
            if s not in self._owner:
                return s
        if not free:
            return None
        # min by score; the LRU order of ``free`` breaks ties (min keeps the first minimum).
        return min(free, key=lambda s: self.score(self._owner[s]))


def make_cache(policy: str, slots: Iterable[int], *, decay: float = 0.99) -> LruSlots:
    if policy == "lru":
        return LruSlots(slots)
    if policy == "lfu":
        return LfuSlots(slots, decay)
    raise ValueError(f"tiers.gpu.cache: unknown policy {policy!r}; allowed: {list(POLICIES)}")


def replay(trace: Sequence[ExpertKey], capacity: int, hot: set[ExpertKey], cache: Callable[[range], LruSlots]) -> int:
    """Hits a policy gets on ``trace`` with ``capacity`` staging slots (hot keys always hit, not counted)."""
    policy = cache(range(capacity))
    where: dict[ExpertKey, int] = {}
    owner: dict[int, ExpertKey] = {}
    readers = [0] * capacity
    hits = 0
    for key in trace:
        if key in hot:
            continue
        policy.access(key)
        slot = where.get(key)
        if slot is not None:
            hits += 1
            policy.touch(slot)
            continue
        slot = policy.victim(readers)
        if slot in owner:
            del where[owner[slot]]
        owner[slot] = key
        where[key] = slot
        policy.assign(slot, key)
    return hits


def belady_hits(trace: Sequence[ExpertKey], capacity: int, hot: set[ExpertKey]) -> int:
    """Belady's MIN: on a miss with a full cache, evict the key whose next use is farthest away."""
    seq = [k for k in trace if k not in hot]
    never = len(seq)
    nxt = [never] * len(seq)
    last: dict[ExpertKey, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cached: dict[ExpertKey, int] = {}  # key -> its next use
    heap: list[tuple[int, ExpertKey]] = []  # (-next use, key), stale entries skipped
    hits = 0
    for i, key in enumerate(seq):
        if key in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                neg, k = heapq.heappop(heap)
                if cached.get(k) == -neg:
                    del cached[k]
                    break
        if capacity == 0:
            continue
        cached[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return hits
