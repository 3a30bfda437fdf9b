"""A change to the decode step graph undone for one arm of ``decode_marks.py``, for an A/B.

``memcpy``: the step's length counters set as before ``tiers.graphs.step_graphs.set_lengths``, a
device copy per layer (in a step graph holding Triton kernels those copies ran on the copy
engine, one after another, at the graph's start). ``patched(names)`` enters the variants named.

The two variants answered earlier (the step graph captured in parts, and the Triton kernels
launched from cubins loaded with ``cuLibraryLoadData``) are in this file at commit 22ff78d;
their results are in ``experiments/README.md``.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def memcpy():
    """The step's length counters set by a device copy per layer."""
    from tiers.graphs import step_graphs

    def copies(cache, position):
        for layer in cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.copy_(position.reshape(length.shape))

    kept, step_graphs.set_lengths = step_graphs.set_lengths, copies
    try:
        yield dict
    finally:
        step_graphs.set_lengths = kept


VARIANTS = {"memcpy": memcpy}


@contextlib.contextmanager
def patched(names: set[str]):
    """The variants of ``names`` that this module knows, entered; yields a function returning what they report."""
    with contextlib.ExitStack() as stack:
        reports = [stack.enter_context(VARIANTS[n]()) for n in sorted(names & VARIANTS.keys())]
        yield lambda: {k: v for r in reports for k, v in r().items()}
