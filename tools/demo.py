"""tiers-demo: pack a MoE, load it through three tiers, generate text, and check it against the untiered model.

    python tools/demo.py [--model DIR] [--workdir DIR] [--device cuda|cpu] [--tokens 24] [--no-check]
    torchrun --nproc-per-node N tools/demo.py --parallel [...]

Without --model, the model is a small byte-level Mixtral-style MoE (vocabulary 256: token ids are
the UTF-8 bytes of the text) with random weights, built from an embedded config (no download), so
its text is printable noise. --model DIR runs an existing Hugging Face checkpoint directory
instead, through its tokenizer if the directory has one, else byte-level.

The YAML puts 25% of expert bytes on the GPU, half the experts as INT8 in pinned RAM and the rest
as INT8 on disk, so every tier serves experts. INT8 changes the numbers, so the exactness check
loads the same pack once more with every tier in bf16 (BF16_YAML says on what conditions): its
greedy tokens must equal those of the untiered model (the checkpoint loaded by transformers'
from_pretrained, with its default experts implementation), or the demo exits with status 1. The
INT8 run is compared too, as a measure, not a promise. Files go to a temporary directory,
removed at the end, unless --workdir names one to keep.

--parallel runs it across the processes torchrun starts (one a GPU, NCCL; or on CPUs, gloo),
with ``tiers.parallel.experts``: each process serves its block of every layer's experts from
its own three tiers. The first process writes and packs the checkpoint and prints; every process
generates, and the demo fails unless all of them return the same tokens.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from tiers.loader.text import TOKENIZER_FILES  # noqa: E402  (a checkpoint carrying one of these has a tokenizer)

DEMO_MODEL = dict(
    model_type="mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=256, max_position_embeddings=512,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,  # bytes, not special tokens: generation never stops early
)
DEMO_YAML = """\
tiers:
  gpu:  {fraction: 0.25}              # of expert bytes at bf16, staging slots included
  cpu:  {fraction: 0.5, precision: int8}
  nvme: {precision: int8}             # everything else
"""
# The exactness check: every tier in bf16, where Tiers computes what transformers' default
# grouped_mm does (and in a GPU's decode, its batched_mm) bit for bit; with graphs off, since step
# graphs decode batch-1 steps on a static KV cache of their own (close to the untiered model, not
# bit for bit).
BF16_YAML = """\
tiers:
  gpu:  {fraction: 0.5, graphs: false}
  cpu:  {fraction: 0.25, precision: bf16}
  nvme: {precision: bf16}
"""
PARALLEL_YAML = """\
  parallel: {experts: true}          # each process serves its block of every layer's experts
"""
PROMPT = "Experts live in three tiers:"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tiers-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an existing Hugging Face checkpoint directory (default: a synthetic byte-level MoE)")
    ap.add_argument("--workdir", help="where to write the checkpoint, the pack and the YAMLs, kept afterwards "
                    "(default: a temporary directory, removed at the end)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--tokens", type=int, default=24, help="tokens to generate")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with the untiered model (which loads "
                    "the whole model on the device, and a second Tiers model)")
    ap.add_argument("--parallel", action="store_true", help="expert parallelism across the processes torchrun starts")
    args = ap.parse_args(argv)
    if args.parallel:
        return _parallel(args)
    if args.model and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model!r}: no config.json there (expected a save_pretrained directory)")

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tiers-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"working in {work}" + ("" if args.workdir else " (a temporary directory, removed at the end)"))
        return _run(args, work)
    except (ValueError, OSError) as e:  # a checkpoint pack refuses, a full disk: one line, as tiers-pack says it
        print(f"tiers-demo: error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.workdir:
            print(f"kept in {work}: " + ", ".join(sorted(p.name for p in work.iterdir())))
        else:
            shutil.rmtree(work, ignore_errors=True)
            print(f"removed {work}")


def _parallel(args: argparse.Namespace) -> int:
    """The demo in each process torchrun started: the first one's directory and output, every one's tokens."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        print("tiers-demo: error: --parallel runs under torchrun: torchrun --nproc-per-node N tools/demo.py --parallel", file=sys.stderr)
        return 2
    gpu = args.device != "cpu" and torch.cuda.is_available()
    if gpu:
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(args.device)
    from datetime import timedelta

    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(minutes=10))  # a process that fails stops the rest in time
    try:
        if dist.get_rank() != 0:
            sys.stdout = open(os.devnull, "w")  # one process speaks
        where = [args.workdir or (tempfile.mkdtemp(prefix="tiers-demo-") if dist.get_rank() == 0 else None)]
        dist.broadcast_object_list(where)
        args.workdir = where[0]
        return _in_group(args, dist)
    finally:
        dist.destroy_process_group()


def _in_group(args: argparse.Namespace, dist) -> int:
    """The demo in one of several processes: the first packs, every one loads and generates."""
    work = Path(args.workdir)
    try:
        code = _run(args, work, dist)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"tiers-demo: error: {e}", file=sys.stderr)
        code = 2
    dist.barrier()
    if dist.get_rank() == 0 and "tiers-demo-" in work.name:
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed {work}")
    return code


def _run(args: argparse.Namespace, work: Path, dist=None) -> int:
    from transformers import AutoConfig

    import tiers
    from tiers.loader.pack import pack

    first = dist is None or dist.get_rank() == 0
    if args.model:
        src = Path(args.model)
        print(f"1. the checkpoint {src}")
    elif first:
        src = _synthetic(work / "hf")
    if first:
        print("2. packing")
        print(pack(src, work / "packed", precisions=["bf16", "int8"], overwrite=True))
        (work / "tiers.yaml").write_text(DEMO_YAML + PARALLEL_YAML * (dist is not None))
        if not args.no_check:
            (work / "tiers-bf16.yaml").write_text(BF16_YAML + PARALLEL_YAML * (dist is not None))
    if dist is not None:
        dist.barrier()  # the pack is whole before any process reads it
        src = Path(args.model) if args.model else work / "hf"
    encode, decode = _codec(src, AutoConfig.from_pretrained(src).vocab_size)
    print(f"3. loading through the tiers with {work / 'tiers.yaml'}:\n{(work / 'tiers.yaml').read_text()}")
    with _tiers_model(work / "packed", work / "tiers.yaml", args.device, progress=first) as model:
        device = next(model.parameters()).device
        prompt = torch.tensor([encode(PROMPT)], device=device)  # [1, P]
        print(f"4. prompt {PROMPT!r} ({prompt.shape[1]} tokens)")
        t0 = time.perf_counter()
        int8 = _generate(model, prompt, args.tokens)  # [1, P + tokens]
        print(f"   generated {args.tokens} tokens on {device} in {time.perf_counter() - t0:.2f} s: {decode(int8)!r}")
        print("5. tier stats" + (f", summed over the {dist.get_world_size()} processes:" if dist else ":"))
        print(tiers.stats(model, all_ranks=dist is not None))
    if dist is not None and not _same_everywhere(int8, dist):
        return 1
    if args.no_check:
        return 0
    with _tiers_model(work / "packed", work / "tiers-bf16.yaml", device, progress=False) as model:
        exact = _generate(model, prompt, args.tokens)
        hits = tiers.stats(model).as_dict()["hits"]
    want = _generate(_untiered(src, device), prompt, args.tokens)
    print(f"6. {args.tokens} greedy tokens on {device} from the untiered model ({src} through transformers' from_pretrained, "
          f"its default experts kernels) and from Tiers with every tier in bf16 ({work / 'tiers-bf16.yaml'}; "
          f"experts served by gpu/cpu/nvme: {hits['gpu']}/{hits['cpu']}/{hits['nvme']}):")
    print(f"   untiered:                  {decode(want)!r}")
    print(f"   tiers, every tier in bf16: {decode(exact)!r}")
    print(f"   matches the untiered model: {_verdict(exact, want, prompt.shape[1])} (bf16 tiers must match token for token)")
    print(f"   the INT8 tiers of step 4 match it: {_verdict(int8, want, prompt.shape[1])} (INT8 is approximate: it may differ)")
    return 0 if torch.equal(exact, want) and (dist is None or _same_everywhere(exact, dist)) else 1


def _same_everywhere(tokens: torch.Tensor, dist) -> bool:
    """Whether every process generated ``tokens``; says so."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tokens.tolist())
    same = all(t == every[0] for t in every)
    print(f"   the {len(every)} processes generated the same tokens: {'yes' if same else 'no'}")
    return same


def _verdict(got: torch.Tensor, want: torch.Tensor, p: int) -> str:
    """yes, or no and how many generated tokens agree before the first difference (either may stop early at EOS)."""
    if torch.equal(got, want):
        return "yes"
    n = min(got.shape[1], want.shape[1])
    same = int((got[0, p:n] == want[0, p:n]).long().cumprod(0).sum())
    return f"no, the first {same} of {want.shape[1] - p} tokens agree"


def _synthetic(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kw = dict(DEMO_MODEL)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init: decisive routing, less repetitive text
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        # an output head that only speaks printable ASCII (bytes 32-126), so its noise prints as text
        model.lm_head.weight[:32] = 0
        model.lm_head.weight[127:] = 0
    model.save_pretrained(path)
    print(f"1. wrote a synthetic byte-level {config.model_type} MoE ({config.num_hidden_layers} layers x "
          f"{config.num_local_experts} experts, random weights: its text is printable noise) to {path}")
    return path


def _codec(src: Path, vocab_size: int) -> tuple[Callable[[str], list[int]], Callable[[torch.Tensor], str]]:
    """(text -> token ids, generated ids [1, P + N] -> the new text): the checkpoint's tokenizer, else UTF-8 bytes."""
    n = len(PROMPT.encode("utf-8"))
    if any((src / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(src)
        n = len(tok(PROMPT)["input_ids"])
        return (lambda text: tok(text)["input_ids"]), (lambda ids: tok.decode(ids[0, n:].tolist(), skip_special_tokens=True))
    if vocab_size < 256:
        raise ValueError(f"{src} has no tokenizer and a vocabulary of {vocab_size} (< 256), so it is not byte-level")
    return (lambda text: list(text.encode("utf-8"))), (lambda ids: bytes(i for i in ids[0, n:].tolist() if i < 256).decode("utf-8", "replace"))


def _generate(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy ids [1, P + tokens]."""
    pad = model.generation_config.pad_token_id
    return model.generate(prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0 if pad is None else pad).cpu()


def _untiered(src: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(device).eval()


@contextmanager
def _tiers_model(packed: Path, yaml_path: Path, device, *, progress: bool) -> Iterator[torch.nn.Module]:
    """A Tiers model, its readers and threads stopped on the way out (before its files are removed)."""
    import tiers
    from tiers.api import manager_of

    model = tiers.load(packed, config=yaml_path, device=device, progress=progress)
    try:
        yield model
    finally:
        manager_of(model).close()


if __name__ == "__main__":
    sys.exit(main())
