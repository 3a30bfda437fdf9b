"""Shared by the slot tests: the packed tiny Mixtral and its oracle weights, and a recording Manager over them.

``build`` runs a CPU ``Manager`` with all three tiers in bf16 (so every served expert must be
bit-exact) on recording streams (``tier_fakes``), whose waits, records, syncs and stream switches
go into one ordered list, and every disk read too; it observes the slot protocol without altering it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tier_fakes import Recorder, RecordingStreams, index_of_record, recorded_manager
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest
from tiers.manager import Manager
from tiers.store.disk_store import IntegrityError

MODEL = "mixtral"
PRECISIONS = ("bf16", "int8")


class World:
    """The packed checkpoint and the oracle weights (short repr, so falsifying examples stay readable)."""

    def __init__(self, manifest, truth: dict):
        self.manifest, self.truth = manifest, truth

    def __repr__(self) -> str:
        return f"<packed {MODEL} {PRECISIONS}: {len(self.truth)} experts>"


def load_world(packed_factory, checkpoint_factory) -> World:
    """Every expert's bf16 weights, read through transformers from the source checkpoint (not the pack)."""
    from tiers.loader.layout import find_experts_modules
    from transformers import AutoModelForCausalLM

    manifest = read_manifest(packed_factory(MODEL, PRECISIONS))
    model = AutoModelForCausalLM.from_pretrained(checkpoint_factory(MODEL), dtype=torch.bfloat16)
    out: dict[ExpertKey, dict[str, torch.Tensor]] = {}
    for layer, (_, mod) in find_experts_modules(model).items():
        entry = manifest.layers[layer]
        for e in range(entry.layout.num_experts):
            out[ExpertKey(layer, e)] = {t.name: getattr(mod, t.name)[e].detach().clone() for t in entry.layout.tensors}
    assert set(out) == set(manifest.keys)
    # different experts really differ, so a slot holding the wrong expert cannot pass for the right one
    flat = {k: torch.cat([v.reshape(-1) for v in d.values()]) for k, d in out.items()}
    keys = sorted(flat)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert not torch.equal(flat[a], flat[b])
    return World(manifest, out)


@dataclass(repr=False)
class Harness:
    mgr: Manager
    rec: Recorder
    streams: RecordingStreams
    held: list = field(default_factory=list)  # handles acquired and not yet released
    acquired: list = field(default_factory=list)  # every key Slots.acquire returned a handle for
    writes: list = field(default_factory=list)  # [pool, slot, key, source, entry index, the copy's use index, ready event]
    ready: dict = field(default_factory=dict)  # (pool, slot) -> its latest ready event
    releases: dict = field(default_factory=dict)  # (pool, slot) -> [(last-read event, its record index)] of reads after a wait
    reading: bool = False  # a release now ends a read whose kernels were ordered after the slot's write
    fail_key: ExpertKey | None = None  # the next disk read of this expert fails its checksum (IntegrityError)
    failed_reads: int = 0


def build(manifest, staging: int, gpu_frac: float, cpu_frac: float) -> Harness:
    mgr, rec, streams = recorded_manager(manifest.root, {"gpu": {"fraction": gpu_frac, "precision": "bf16", "staging_slots": staging},
                                                         "cpu": {"fraction": cpu_frac, "precision": "bf16"}, "nvme": {"precision": "bf16"}})
    h = Harness(mgr, rec, streams)
    copy = mgr.staging.copy_stream
    assert len(streams.made) == 1 and copy is streams.made[0] and mgr.staging.dequant_stream is copy, "bf16: one copy stream, from new_stream"
    order, table = rec.order, mgr.table

    # Observe (never alter) the slot protocol: wrap the table's transitions, the staging writes and the disk reads.
    orig_written, orig_release, orig_write = table.written, table.release, mgr.staging.write

    def written(pool, slots, event, stream):
        orig_written(pool, slots, event, stream)
        assert stream is copy and order[index_of_record(order, event)][1] is copy, "ready event recorded on the copy stream"
        for slot in slots:
            h.ready[(pool, slot)] = event
            open_ = [w for w in h.writes if (w[0], w[1]) == (pool, slot) and w[6] is None]
            assert len(open_) == 1, "a ready event for a write never queued (or queued twice)"
            open_[0][6] = event

    def release(pool, slot, last_read):
        n = len(order)
        orig_release(pool, slot, last_read)
        assert len(order) == n, "a release queues nothing"
        if last_read is None:
            return
        assert not table.is_hot_slot(pool, slot), "hot slots are never rewritten: their readers record no last-read"
        at = index_of_record(order, last_read)
        assert order[at][1] is streams.compute, "last-read recorded on the compute stream"
        if h.reading:
            h.releases.setdefault((pool, slot), []).append((last_read, at))

    def write(key, pool, slot, precision, source, src, direct_ok=True):
        if mgr.staging._batch is None:  # outside a batch: a batch of one, around this very call again
            return orig_write(key, pool, slot, precision, source, src, direct_ok)
        begin = len(order)
        orig_write(key, pool, slot, precision, source, src, direct_ok)
        uses = [i for i in range(begin, len(order)) if order[i][0] == "use" and order[i][1] is copy]
        assert uses, f"{key} was written into slot {slot} outside the copy stream"
        assert table.occupant(pool.index, slot) == key
        h.writes.append([pool.index, slot, key, source, begin, uses[0], None])

    table.written, table.release, mgr.staging.write = written, release, write

    orig_acquire = mgr.slots.acquire

    def acquire(key):
        got = orig_acquire(key)
        if got is not None:
            h.acquired.append(key)
        return got

    mgr.slots.acquire = acquire

    orig_read = mgr.disk.read

    def disk_read(key, precision, out):
        order.append(("disk_read", None, key))
        if key == h.fail_key:
            h.fail_key = None
            h.failed_reads += 1
            out[: manifest.ref(key, precision).nbytes].fill_(0x5A)  # a torn read leaves garbage in the buffer
            raise IntegrityError(f"injected: checksum mismatch for {key}")
        return orig_read(key, precision, out)

    mgr.disk.read = disk_read
    return h


def fractions(manifest, staging: int, n_hot: int, n_warm: int) -> tuple[float, float]:
    n = len(manifest.keys)
    return (staging + n_hot + 0.5) / n, (n_warm + 0.5) / n  # all experts have the same size


def assert_holds(t: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(t) == set(want)
    for name in want:
        assert torch.equal(t[name], want[name]), f"{what}: {name} differs from the checkpoint"
