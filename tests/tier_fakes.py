"""Recording fakes of streams and events for the slot-rule tests, and a CPU manager built on them.

Every ``wait_event``, ``record``, ``synchronize`` and ``use`` goes into one ordered list
(``Recorder.order``) as ``(what, stream, event)``, so a test can check that a copy into a slot
was queued after the slot's last read, and a kernel after the slot's copy.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tiers.config import load_config
from tiers.loader.packed import read_manifest
from tiers.manager import Manager
from tiers.policy.placement import plan_placement
from tiers.transfer.streams import Streams


class Recorder:
    def __init__(self):
        self.order: list[tuple] = []
        self.n_events = 0


class FakeStream:
    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def wait_event(self, ev) -> None:
        assert isinstance(ev, FakeEvent), f"waited on {ev!r}, not an event"
        assert ev.recorded, f"{self} waits on {ev}, which was never recorded"
        self.rec.order.append(("wait", self, ev))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, rec: Recorder, blocking: bool = False):
        self.rec, self.blocking = rec, blocking
        rec.n_events += 1
        self.id = rec.n_events
        self.recorded = False

    def record(self, stream=None) -> None:
        assert isinstance(stream, FakeStream), f"event recorded on {stream!r}"
        self.recorded = True
        self.rec.order.append(("record", stream, self))

    def synchronize(self) -> None:
        self.rec.order.append(("sync", None, self))

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0

    def __repr__(self) -> str:
        return f"<event {self.id}>"


class RecordingStreams(Streams):
    """``tiers.transfer.streams.Streams`` on the CPU whose streams and events record into ``rec``."""

    def __init__(self, rec: Recorder):
        super().__init__(torch.device("cpu"))
        self.rec = rec
        self.compute = FakeStream(rec, "compute")
        self.made: list[FakeStream] = []

    def new_stream(self):
        s = FakeStream(self.rec, f"side{len(self.made)}")
        self.made.append(s)
        return s

    def current(self):
        return self.compute

    def event(self, timing: bool = False, blocking: bool = False):
        return FakeEvent(self.rec, blocking)

    def use(self, stream):
        self.rec.order.append(("use", stream, None))
        return contextlib.nullcontext()


def waits_between(order, lo: int, hi: int, stream, ev) -> bool:
    """Whether ``stream`` waited on ``ev`` within ``order[lo:hi]``."""
    return any(o[0] == "wait" and o[1] is stream and o[2] is ev for o in order[lo:hi])


def index_of_record(order, ev) -> int:
    """Where ``ev`` was (last) recorded in ``order``."""
    return max(i for i, o in enumerate(order) if o[0] == "record" and o[2] is ev)


def recorded_manager(packed: Path, tiers: dict) -> tuple[Manager, Recorder, RecordingStreams]:
    """A CPU ``Manager`` over ``packed`` under the YAML dict ``tiers`` (the ``tiers:`` section), on recording streams."""
    rec = Recorder()
    streams = RecordingStreams(rec)
    cfg = load_config({"tiers": tiers})
    manifest = read_manifest(packed)
    mgr = Manager(manifest, cfg, plan_placement(cfg, manifest), device=torch.device("cpu"), streams=streams, progress=False)
    return mgr, rec, streams
