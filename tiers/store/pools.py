"""GPU memory for experts: static slot pools keyed by (dtype, shape, stride), and the blob pool of quantized hot experts.

Owns memory only: per pool one slab ``[n_slots, *shape]`` per expert tensor name, slot ``i``
being row ``i`` of every slab, so a slot's addresses never change and CUDA graphs that read it
stay valid. Who sits in a slot, and whether it may be written, is the table's
(``tiers.store.table``). A pool serves the layers whose experts share one signature; its hot
slots come first, its staging slots after.

``BlobPool``: with ``tiers.gpu.precision`` not bf16, the hot experts stay in their packed form on
the GPU, one buffer placed once at load (4 KiB aligned, as the host pool places blobs); a call
that uses one dequantizes it into a staging slot, copying device to device.
"""
from __future__ import annotations

import torch

from tiers.loader.blob import BLOB_ALIGN, align
from tiers.loader.layout import ExpertLayout


class BlobPool:
    """Quantized hot experts' blobs in one GPU buffer of ``capacity`` bytes (a bump allocator)."""

    def __init__(self, capacity: int, device: torch.device):
        self.slab = torch.empty(max(capacity, BLOB_ALIGN), dtype=torch.uint8, device=device)
        self.capacity, self.used = capacity, 0

    def alloc(self, nbytes: int) -> int:
        offset, self.used = self.used, self.used + align(nbytes, BLOB_ALIGN)
        if self.used > self.capacity:
            raise MemoryError(f"the GPU blob pool holds {self.capacity} bytes; {self.used} asked")
        return offset

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.slab[offset : offset + nbytes]


class SlotPool:
    def __init__(self, index: int, layout: ExpertLayout, n_slots: int, hot: int, *, device: torch.device, dtype: torch.dtype):
        self.index = index  # the pool's number in the table
        self.layout = layout
        self.n_slots = n_slots
        self.hot = hot  # slots [0, hot) are hot, [hot, n_slots) staging
        self.dtype = dtype
        self.slabs = {t.name: torch.empty((n_slots, *t.shape), dtype=dtype, device=device) for t in layout.tensors}  # name -> [n_slots, *shape]
        self._rows = [{name: slab[i] for name, slab in self.slabs.items()} for i in range(n_slots)]  # slot -> its views

    @property
    def staging(self) -> range:
        return range(self.hot, self.n_slots)

    @property
    def key(self) -> tuple:
        """The (dtype, shape, stride) signature slots of this pool are interchangeable under."""
        return tuple((n, self.dtype, tuple(s.shape[1:]), tuple(s.stride()[1:])) for n, s in self.slabs.items())

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slabs.values())

    @property
    def slot_bytes(self) -> int:
        return self.nbytes // max(self.n_slots, 1)

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        return self._rows[slot]
