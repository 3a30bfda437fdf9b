"""Streams and events of one device, injectable so CPU tests run the same code.

Owns: making streams and events through ``torch.get_device_module(device)`` (``torch.cpu``
supplies working stubs), and switching the current stream cheaply on CUDA. Tests pass a
recording fake with the same methods.
"""
from __future__ import annotations

from typing import Any

import torch


class Streams:
    """Streams and events of one device; tests pass a recording fake with the same methods.

    On CUDA, ``current`` and ``use`` run on every staged expert, so they skip what
    ``torch.cuda.current_stream`` and ``torch.cuda.stream`` do on each call (resolve the device,
    build a new ``Stream`` object inside a device guard): the current stream is looked up by id
    among the streams seen before, and ``use`` sets and restores it with ``torch.cuda.set_stream``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = torch.get_device_module(device)
        self.cuda = device.type == "cuda"
        self.index = device.index if device.index is not None else (torch.cuda.current_device() if self.cuda else 0)
        self._seen: dict[int, Any] = {}  # stream id -> its Stream object

    def new_stream(self) -> Any:
        return self.module.Stream(device=self.device) if self.cuda else self.module.Stream()

    def current(self) -> Any:
        if not self.cuda:
            return self.module.current_stream()
        sid = torch._C._cuda_getCurrentStream(self.index)[0]
        stream = self._seen.get(sid)
        if stream is None:
            stream = self._seen[sid] = self.module.current_stream(self.device)
        return stream

    def event(self, timing: bool = False, blocking: bool = False) -> Any:
        """A new event; ``blocking``: a thread that waits for it sleeps until it fires (CUDA's
        blocking sync) rather than spinning a core, for waits off the serving thread."""
        return self.module.Event(enable_timing=timing, blocking=blocking) if self.cuda else self.module.Event()

    def use(self, stream: Any):
        if self.cuda and torch.cuda.current_device() == self.index:
            return _Use(self, stream)
        return self.module.stream(stream)  # the CPU, or another device current: the general context


class _Use:
    """``with streams.use(s)``: ``s`` is the current stream inside, the previous one after."""

    __slots__ = ("streams", "stream", "prev")

    def __init__(self, streams: Streams, stream: Any):
        self.streams, self.stream = streams, stream

    def __enter__(self) -> None:
        self.prev = self.streams.current()
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.prev)
