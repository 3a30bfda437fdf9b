"""Reading and corrupting one expert's blob in a packed checkpoint's files, independently of tiers' own readers."""
from __future__ import annotations

from pathlib import Path

import torch

from conftest import flip_byte
from tiers.loader.layout import ExpertKey
from tiers.loader.packed import read_manifest


def corrupt_expert(root: Path, key: ExpertKey, precision: str, where: float = 0.5) -> Path:
    """Flip one byte inside ``key``'s blob (not in its padding). Returns the file."""
    ref = read_manifest(root).ref(key, precision)
    flip_byte(root / ref.file, ref.offset + min(int(ref.nbytes * where), ref.nbytes - 1))
    return root / ref.file


def decoded(root: Path, key: ExpertKey, precision: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """What a correct read of ``key`` must give: the blob in the file, decoded alone on ``device``."""
    m = read_manifest(root)
    ref = m.ref(key, precision)
    with open(root / ref.file, "rb") as f:
        f.seek(ref.offset)
        blob = torch.frombuffer(bytearray(f.read(ref.nbytes)), dtype=torch.uint8).to(device)
    out = {t.name: torch.empty(t.shape, dtype=torch.bfloat16, device=device) for t in m.layers[key.layer].layout.tensors}
    m.blob(key, precision).dequantize_into(blob, out)
    return out
