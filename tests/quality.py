"""Quality figures of a byte-level language model over windows of held-out text.

One measurement, shared by tests/tiers/test_trained_model.py and experiments/trained_quality.py:
``figures`` compares the logits of a model under test with a reference model's over the same
windows of bytes. Every position t < L-1 of a window of L bytes predicts byte t+1 from bytes <= t,
so W windows of L bytes give W*(L-1) predictions, and every figure is a mean over them:

- bits per byte: the cross-entropy of the byte that follows, in bits (of the reference and of the
  model under test);
- mean KL: KL(reference || model) per predicted byte, in nats;
- top-1 agreement: the share of predictions whose most likely next byte is the same.

Logits are compared in float32 (upcast from the models' bf16).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# The trained byte-level Qwen3-MoE (vocab 256, token ids = UTF-8 bytes) lives beside the repository,
# in ../shared/models/ (see that folder's README.md); a fresh clone elsewhere does not have it.
TRAINED_MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "qwen3-moe-bytes-6m"


def trained_model_missing() -> str | None:
    """Why the trained model cannot be used here, or None where it can."""
    for name in ("config.json", "model.safetensors", "eval.txt"):
        if not (TRAINED_MODEL / name).is_file():
            return f"the trained model is absent: no {name} in ../shared/models/qwen3-moe-bytes-6m beside the repository"
    return None


def eval_windows(text: bytes, count: int, length: int) -> torch.Tensor:
    """``count`` windows of ``length`` bytes of ``text``, evenly spaced from its first byte to its
    last (the first starts at byte 0, the last ends at the end): token ids [count, length]."""
    if length < 2 or count < 1 or len(text) < length:
        raise ValueError(f"cannot take {count} windows of {length} bytes from {len(text)} bytes")
    last = len(text) - length
    starts = [i * last // (count - 1) if count > 1 else 0 for i in range(count)]
    return torch.tensor([list(text[s:s + length]) for s in starts], dtype=torch.long)


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits [W, L, vocab] over the windows, all windows in one batched forward."""
    return model(ids.to(model.device)).logits.cpu()


@dataclass(frozen=True)
class Figures:
    predictions: int  # W * (L - 1) predicted bytes
    bits_per_byte_ref: float
    bits_per_byte: float
    mean_kl: float  # nats per predicted byte, KL(reference || model)
    top1_agreement: float

    def as_dict(self) -> dict:
        return asdict(self)


def figures(ref_logits: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> Figures:
    """Bits per byte of both, mean KL(reference || model) and top-1 agreement, over the windows ``ids``
    [W, L] whose logits [W, L, vocab] are ``ref_logits`` (reference) and ``logits`` (model under test)."""
    if ref_logits.shape != logits.shape or ref_logits.shape[:2] != ids.shape:
        raise ValueError(f"shapes differ: reference {tuple(ref_logits.shape)}, model {tuple(logits.shape)}, ids {tuple(ids.shape)}")
    vocab = logits.shape[-1]
    target = ids[:, 1:].reshape(-1)  # [N] the byte each position predicts
    log_p = F.log_softmax(ref_logits[:, :-1].float().reshape(-1, vocab), dim=-1)  # [N, vocab]
    log_q = F.log_softmax(logits[:, :-1].float().reshape(-1, vocab), dim=-1)
    n = target.numel()
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum").item() / n  # sum p (log p - log q)
    return Figures(
        predictions=n,
        bits_per_byte_ref=F.nll_loss(log_p, target).item() / math.log(2),
        bits_per_byte=F.nll_loss(log_q, target).item() / math.log(2),
        mean_kl=kl,
        top1_agreement=(log_p.argmax(-1) == log_q.argmax(-1)).float().mean().item(),
    )
