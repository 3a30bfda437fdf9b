"""Where the trained byte-level model lives, and the quality figures the tests and experiments take over it.

The figures (``eval_windows``, ``logits_of``, ``figures``, ``Figures``) are the library's own,
``tiers.tools.quality`` (tiers-quality); they are imported here so that
tests/tiers/test_trained_model.py and experiments/trained_quality.py take the same measurement.
A byte-level model's tokens are bytes: there bits per token are bits per byte.
"""
from __future__ import annotations

from pathlib import Path

from tiers.tools.quality import Figures, eval_windows, figures, logits_of

__all__ = ["TRAINED_MODEL", "Figures", "eval_windows", "figures", "logits_of", "trained_model_missing"]

# The trained byte-level Qwen3-MoE (vocab 256, token ids = UTF-8 bytes) lives beside the repository,
# in ../shared/models/ (see that folder's README.md); a fresh clone elsewhere does not have it.
TRAINED_MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "qwen3-moe-bytes-6m"


def trained_model_missing() -> str | None:
    """Why the trained model cannot be used here, or None where it can."""
    for name in ("config.json", "model.safetensors", "eval.txt"):
        if not (TRAINED_MODEL / name).is_file():
            return f"the trained model is absent: no {name} in ../shared/models/qwen3-moe-bytes-6m beside the repository"
    return None
