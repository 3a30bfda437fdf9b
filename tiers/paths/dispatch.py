"""The one decision: which path serves a layer call, from explicit facts about it.

``dispatch`` is a pure function of ``Facts``; ``docs/architecture.md`` gives its table. The paths
that need the routing on the host (held, streamed) are chosen after the routing sync: before it,
``dispatch`` answers ``ROUTE``, and the caller routes and asks again with the routed facts.

| facts (first match wins)                                               | path      |
|------------------------------------------------------------------------|-----------|
| every expert of the layer is hot                                       | resident  |
| decode, the layer's direct tables qualify, enough reserved slots       | direct    |
| prefill, long enough to route to every expert, the layer's experts in no slot all warm and more than half the free staging slots hold, no trace | whole |
| routing not on the host yet                                            | (route)   |
| its non-hot experts fit the free staging slots, and (prefill) its misses fit half of them | held |
| otherwise                                                              | streamed  |
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Path(str, Enum):
    RESIDENT = "resident"  # paths.resident: all hot, no sync
    DIRECT = "direct"  # paths.direct: decode, the GPU reads its misses from pinned memory, no sync
    WHOLE = "whole"  # paths.whole: a long prefill reads every warm expert of its layer, no sync
    ROUTE = "route"  # not a path: bring the routing to the host, then dispatch again
    HELD = "held"  # paths.held: every routed expert held at once
    STREAMED = "streamed"  # paths.streamed: misses read part by part through two buffers


@dataclass(frozen=True)
class Facts:
    """What the decision reads about one layer call."""

    all_hot: bool  # every expert of the layer is hot
    decoding: bool  # inside generate's decode stage
    direct: bool  # the direct path can take this call now (tables built, slots reserved for its picks)
    whole: bool  # long enough, and the layer's last long call used its warm experts (``WholePath.qualifies``)
    cold: bool  # some expert of the layer in no slot lives on disk only
    recording: bool  # a routing trace is being recorded (every lookup on the host)
    room: int  # staging slots the call may use
    layer_misses: int  # experts of the layer in no slot
    routed: bool = False  # the facts below are known (after the routing sync)
    picks_known: bool = False  # the picks themselves came to the host (a short call)
    need: int = 0  # routed experts that are not hot (each needs a staging slot)
    misses: int = 0  # ... of which in no slot now


def dispatch(f: Facts) -> Path:
    if f.all_hot:
        return Path.RESIDENT
    if f.decoding and f.direct:
        return Path.DIRECT
    if not f.decoding and f.whole and not f.cold and not f.recording and f.room >= 2 and f.layer_misses > f.room // 2:
        return Path.WHOLE
    if not f.routed:
        return Path.ROUTE
    if f.need <= f.room and (f.picks_known or f.room < 2 or f.misses <= f.room // 2):
        return Path.HELD
    return Path.STREAMED
