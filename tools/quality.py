"""tiers-quality: how far each packed precision's experts move a model's predictions from its bf16 experts.

    python tools/quality.py PACKED TEXT [--precisions int8,bnb8] [--windows 16] [--length 512] [--batch 8]
                            [--greedy-prompts 4] [--greedy-tokens 32] [--max-kl NATS] [--json FILE] [--device cuda|cpu]

For each precision P packed in PACKED other than bf16 (or those ``--precisions`` names), the model
with every expert dequantized from P's blobs (``tiers.gpu.fraction`` 1, ``tiers.gpu.precision`` P)
is compared with the reference, the same pack with every expert in bf16, over W windows of L
tokens of TEXT, evenly spaced from its first token to its last. Every position t < L-1 of a window
predicts token t+1 from tokens <= t, so the windows give W*(L-1) predictions, and the figures
(``figures``) are means over them:

- bits per token: the cross-entropy of the token that follows, in bits, of the reference and of P
  (bits per byte for a byte-level model: vocabulary 256 and no tokenizer, token ids = UTF-8 bytes);
- mean KL: KL(reference || P) per predicted token, in nats;
- top-1 agreement: the share of predictions whose most likely next token is the same;
- greedy agreement: from the first halves of ``--greedy-prompts`` of the windows, both models
  generate ``--greedy-tokens`` tokens greedily; the share of generated positions, compared position
  by position, whose tokens are equal (a model stopped at EOS pads with its pad id).

TEXT is UTF-8 text, tokenized by the pack's tokenizer when it carries one (no special tokens added),
else as its bytes for a byte-level model; or token ids: ``.json`` (a list of ints) or ``.npy`` (a
1-D integer array). Logits are compared in float32 (upcast from the models' bf16).

Exit status: 0; 1 when a precision's mean KL is above ``--max-kl`` (naming it and the bound), so
that a script can guard a pack with it; 2 on bad input, with one line on stderr naming the file,
key or value, before any model runs.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import asdict, astuple, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from tiers.loader.packed import Manifest, read_manifest  # noqa: E402
from tiers.loader.text import TOKENIZER_FILES, Text, eval_windows, read_tokens  # noqa: E402

REFERENCE = "bf16"
# What a user can cause and fix (a bad path, pack, text or precision): one line on stderr and exit
# status 2. Anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (ValueError, OSError)


# -- the figures ------------------------------------------------------------------------------
@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits [W, L, vocab] over the windows, all windows in one batched forward."""
    return model(ids.to(model.device)).logits.cpu()


@dataclass(frozen=True)
class Figures:
    """Means over predictions. A byte-level model's tokens are bytes: there, bits per token are bits
    per byte (``bits_per_byte``, and ``as_dict(unit="byte")``)."""

    predictions: int  # W * (L - 1) predicted tokens
    bits_per_token_ref: float
    bits_per_token: float
    mean_kl: float  # nats per predicted token, KL(reference || model)
    top1_agreement: float

    @property
    def bits_per_byte_ref(self) -> float:
        return self.bits_per_token_ref

    @property
    def bits_per_byte(self) -> float:
        return self.bits_per_token

    def as_dict(self, unit: str = "token") -> dict:
        return {k.replace("_token", f"_{unit}"): v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Totals:
    """Sums over the predictions of some windows, added batch by batch: a batch's float32 mean
    cross-entropies weighted by its predictions, its KL summed, its agreeing predictions counted."""

    predictions: int = 0
    nats_ref: float = 0.0
    nats: float = 0.0
    kl: float = 0.0
    agree: int = 0

    def __add__(self, other: "Totals") -> "Totals":
        return Totals(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def figures(self) -> Figures:
        n = self.predictions
        if n == 0:
            raise ValueError("no predictions to take figures over")
        return Figures(predictions=n, bits_per_token_ref=self.nats_ref / n / math.log(2), bits_per_token=self.nats / n / math.log(2),
                       mean_kl=self.kl / n, top1_agreement=self.agree / n)


def totals(ref_logits: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> Totals:
    """The sums behind ``figures`` over the windows ``ids`` [W, L], whose logits [W, L, vocab] are
    ``ref_logits`` (reference) and ``logits`` (model under test)."""
    if ref_logits.shape != logits.shape or ref_logits.shape[:2] != ids.shape:
        raise ValueError(f"shapes differ: reference {tuple(ref_logits.shape)}, model {tuple(logits.shape)}, ids {tuple(ids.shape)}")
    vocab = logits.shape[-1]
    target = ids[:, 1:].reshape(-1)  # [N] the token each position predicts
    log_p = F.log_softmax(ref_logits[:, :-1].float().reshape(-1, vocab), dim=-1)  # [N, vocab]
    log_q = F.log_softmax(logits[:, :-1].float().reshape(-1, vocab), dim=-1)  # [N, vocab]
    n = target.numel()
    return Totals(
        predictions=n,
        nats_ref=F.nll_loss(log_p, target).item() * n,
        nats=F.nll_loss(log_q, target).item() * n,
        kl=F.kl_div(log_q, log_p, log_target=True, reduction="sum").item(),  # sum p (log p - log q)
        agree=int((log_p.argmax(-1) == log_q.argmax(-1)).sum()),
    )


def figures(ref_logits: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> Figures:
    """Bits per token of both, mean KL(reference || model) and top-1 agreement, over the windows ``ids``
    [W, L] whose logits [W, L, vocab] are ``ref_logits`` (reference) and ``logits`` (model under test)."""
    return totals(ref_logits, logits, ids).figures()


# -- the input, checked before any model runs -------------------------------------------------
def precisions_to_compare(manifest: Manifest, asked: str | None) -> list[str]:
    """The precisions to measure: those ``--precisions`` names (each packed), else every packed one but bf16."""
    root = str(manifest.root)
    if REFERENCE not in manifest.precisions:
        raise ValueError(f"{root}: holds no bf16 experts to compare with (packed: {', '.join(manifest.precisions)}); "
                         f"re-pack with --precisions bf16,...")
    if asked is None:
        out = [p for p in manifest.precisions if p != REFERENCE]
        if not out:
            raise ValueError(f"{root}: holds only bf16 experts, nothing to compare with them; re-pack with --precisions bf16,int8")
        return out
    out = list(dict.fromkeys(p.strip() for p in asked.split(",") if p.strip()))
    for p in out:
        if p == REFERENCE:
            raise ValueError(f"--precisions: {p!r} is the reference; name the precisions to compare with it")
        if p not in manifest.precisions:
            raise ValueError(f"--precisions: {p!r} is not packed in {root} (packed: {', '.join(manifest.precisions)})")
    if not out:
        raise ValueError(f"--precisions: {asked!r} names no precision")
    return out


def vocab_size(manifest: Manifest) -> int:
    """The model's vocabulary size, from the pack's config.json."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(manifest.root))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{manifest.root / 'config.json'}: cannot read the model's config ({e})") from None
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{manifest.root / 'config.json'}: vocab_size is {vocab!r}, not a vocabulary size")
    return vocab


def has_tokenizer(manifest: Manifest) -> bool:
    return any(name in manifest.carried for name in TOKENIZER_FILES)


def read_text(path: str, manifest: Manifest, vocab: int) -> Text:
    """TEXT's token ids, each checked against the vocabulary (``loader.text.read_tokens``): ids from
    .json or .npy, else UTF-8 text through the pack's tokenizer, else (byte-level model) its bytes."""
    return read_tokens(path, vocab, manifest.root, tokenizer=has_tokenizer(manifest))


# -- running the models -----------------------------------------------------------------------
@contextmanager
def loaded(packed: str, precision: str, device: str) -> Iterator[torch.nn.Module]:
    """The pack with every expert in ``precision`` (hot on the device as far as the budget of all
    experts' bf16 bytes holds them, any other warm or cold in the same precision); its readers
    stopped and its memory freed on the way out, before the next model loads."""
    import tiers
    from tiers.api import manager_of

    every = {"gpu": {"fraction": 1.0, "precision": precision}, "cpu": {"precision": precision}, "nvme": {"precision": precision}}
    model = tiers.load(packed, {"tiers": every}, device=device, progress=False)
    try:
        yield model
    finally:
        manager_of(model).close()
        del model
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, tokens: int) -> torch.Tensor:
    """The ``tokens`` ids [P, tokens] each prompt of ``prompts`` [P, T] greedily generates (after an
    EOS, the pad id, to the full length)."""
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    x = prompts.to(model.device)  # [P, T]
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
    new = out[:, x.shape[1]:].cpu()  # [P, <= tokens]
    return F.pad(new, (0, tokens - new.shape[1]), value=pad)  # [P, tokens]


def prompt_rows(windows: int, prompts: int) -> list[int]:
    """Which of the windows give the greedy prompts: ``prompts`` of them, evenly spaced."""
    return [i * (windows - 1) // (prompts - 1) if prompts > 1 else 0 for i in range(prompts)]


def measure(ref, model, ids: torch.Tensor, batch: int, bar) -> Totals:
    """The sums of ``model`` against ``ref`` over the windows ``ids`` [W, L], ``batch`` windows a forward.
    The reference's logits are recomputed for each model rather than kept: W x L x vocab logits of a
    large vocabulary are gigabytes, and a batch's are freed before the next."""
    out = Totals()
    for i in range(0, ids.shape[0], batch):
        part = ids[i:i + batch]  # [B, L]
        out = out + totals(logits_of(ref, part), logits_of(model, part), part)
        bar.update(1)
    return out


def run(args, text: Text, precisions: list[str]) -> dict:
    """Every figure of every precision against the reference (the JSON document, less the command)."""
    ids = eval_windows(text.ids, args.windows, args.length)  # [W, L]
    prompts = ids[prompt_rows(args.windows, args.greedy_prompts), :args.length // 2] if args.greedy_prompts else None  # [P, L/2]
    batches = math.ceil(args.windows / args.batch)
    result = {"pack": str(args.packed), "text": str(args.text), "text_read_as": text.source, "unit": text.unit,
              "tokens": int(text.ids.numel()), "device": args.device,
              "windows": {"count": args.windows, "length": args.length, "predictions": args.windows * (args.length - 1),
                          "batch": args.batch},
              "greedy": {"prompts": args.greedy_prompts, "prompt_tokens": args.length // 2, "tokens": args.greedy_tokens},
              "max_kl": args.max_kl, "precisions": {}}
    off = args.no_progress
    with loaded(args.packed, REFERENCE, args.device) as ref:
        want = greedy(ref, prompts, args.greedy_tokens) if prompts is not None else None
        for p in tqdm(precisions, desc="precisions", unit="precision", disable=off):
            with loaded(args.packed, p, args.device) as model, tqdm(total=batches, desc=p, unit="batch", leave=False, disable=off) as bar:
                row = measure(ref, model, ids, args.batch, bar).figures().as_dict(text.unit)
                got = greedy(model, prompts, args.greedy_tokens) if prompts is not None else None
            row["greedy_agreement"] = (got == want).float().mean().item() if prompts is not None else None
            result["precisions"][p] = row
    return result


# -- the command line -------------------------------------------------------------------------
def table(result: dict) -> str:
    u = result["unit"]
    head = f"{'precision':<10} {'bits/' + u + ' ref':>15} {'bits/' + u:>11} {'mean KL (nats)':>15} {'top-1':>7} {'greedy':>7}"
    title = (f"{result['pack']}: {result['windows']['count']} windows of {result['windows']['length']} {u}s "
             f"({result['windows']['predictions']} predictions), against bf16")
    lines = [title, head]
    for p, r in result["precisions"].items():
        g = r["greedy_agreement"]
        lines.append(f"{p:<10} {r[f'bits_per_{u}_ref']:>15.4f} {r[f'bits_per_{u}']:>11.4f} {r['mean_kl']:>15.3e} "
                     f"{r['top1_agreement']:>7.4f} {'-' if g is None else f'{g:.4f}':>7}")
    return "\n".join(lines)


def _count(least: int):
    def parse(s: str) -> int:
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} is less than {least}")
        return n
    return parse


def _bound(s: str) -> float:
    try:
        x = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not x >= 0 or math.isinf(x):
        raise argparse.ArgumentTypeError(f"{s!r} is not a finite number >= 0")
    return x


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tiers-quality", description=__doc__.splitlines()[0])
    ap.add_argument("packed", help="a packed checkpoint holding bf16 experts and at least one other precision")
    ap.add_argument("text", help="UTF-8 text, or token ids: .json (a list of ints) or .npy (a 1-D integer array)")
    ap.add_argument("--precisions", help="comma-separated precisions to compare with bf16 (default: every other one packed)")
    ap.add_argument("--windows", type=_count(1), default=16, help="windows of the text (default 16)")
    ap.add_argument("--length", type=_count(2), default=512, help="tokens per window (default 512)")
    ap.add_argument("--batch", type=_count(1), default=8, help="windows per forward (default 8)")
    ap.add_argument("--greedy-prompts", type=_count(0), default=4, help="windows whose first half prompts greedy generation (default 4; 0: none)")
    ap.add_argument("--greedy-tokens", type=_count(1), default=32, help="tokens each prompt generates (default 32)")
    ap.add_argument("--max-kl", type=_bound, metavar="NATS", help="exit 1 when a precision's mean KL is above this")
    ap.add_argument("--json", metavar="FILE", help="write every figure and the command line here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = parser()
    args = ap.parse_args(argv)
    if args.greedy_prompts > args.windows:
        ap.error(f"--greedy-prompts {args.greedy_prompts} is more than --windows {args.windows}: prompts are taken from the windows")
    try:
        if args.json and not Path(args.json).resolve().parent.is_dir():
            raise ValueError(f"--json {args.json}: its folder does not exist")
        manifest = read_manifest(args.packed)
        precisions = precisions_to_compare(manifest, args.precisions)
        text = read_text(args.text, manifest, vocab_size(manifest))
        if text.ids.numel() < args.length:
            raise ValueError(f"{args.text}: {text.ids.numel()} {text.unit}s, shorter than one window of --length {args.length}")
        result = {"command": shlex.join(["tiers-quality", *argv]), **run(args, text, precisions)}
    except EXPECTED_ERRORS as e:
        msg = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        print(f"tiers-quality: error: {msg}", file=sys.stderr)
        return 2
    above = {p: r["mean_kl"] for p, r in result["precisions"].items() if args.max_kl is not None and r["mean_kl"] > args.max_kl}
    result["passed"] = not above
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if above:
        print("tiers-quality: mean KL above --max-kl " + f"{args.max_kl:g}: " + ", ".join(f"{p} {kl:.3e} nats" for p, kl in above.items()),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
