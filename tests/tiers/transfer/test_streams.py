"""Streams of one device (tiers.transfer.streams): the current stream and switching it."""
from __future__ import annotations

import torch

from tiers.transfer.streams import Streams


def test_streams_current_and_use_follow_the_device_module(device):
    """``Streams.current`` is the device's current stream, and ``use(s)`` makes ``s`` current
    inside and restores the previous one after, nested and inside a caller's own stream context
    (on CUDA through its own fast path, checked against torch's)."""
    st = Streams(device)
    mod = torch.get_device_module(device)
    now = (lambda: mod.current_stream(device)) if device.type == "cuda" else mod.current_stream
    base = now()
    assert st.current() == base
    a, b, user = st.new_stream(), st.new_stream(), st.new_stream()
    with st.use(a):
        assert now() == a and st.current() == a
        with st.use(b):
            assert now() == b and st.current() == b
        assert now() == a and st.current() == a
    assert now() == base and st.current() == base
    with mod.stream(user):
        assert st.current() == user
        with st.use(a):
            assert now() == a
        assert now() == user and st.current() == user
    assert now() == base
    if device.type == "cuda":  # work queued inside use() runs on that stream
        x = torch.ones(1 << 20, device=device)
        with st.use(a):
            y = x * 2
            ev = st.event()
            ev.record(a)
        ev.synchronize()
        assert float(y[0]) == 2.0 and a.query()
