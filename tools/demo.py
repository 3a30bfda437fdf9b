"""tiers-demo: the whole path on a synthetic MoE: save_pretrained, pack, load through three tiers, generate.

    python tools/demo.py [--workdir DIR] [--device cuda|cpu] [--tokens 16]

The model is a small Mixtral-style MoE with random weights built from an embedded config (no
download). The YAML puts 25% of expert bytes on the GPU, half the experts as INT8 in pinned
RAM and the rest as INT8 on disk, so every tier serves experts.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages, not this folder's files
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

DEMO_MODEL = dict(
    model_type="mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=512,
)
DEMO_YAML = """\
tiers:
  gpu:  {fraction: 0.25}              # of expert bytes at bf16, staging slots included
  cpu:  {fraction: 0.5, precision: int8}
  nvme: {precision: int8}             # everything else
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tiers-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", help="where to write the checkpoint, the pack and the YAML (default: a temp dir)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to generate")
    args = ap.parse_args(argv)

    from transformers import AutoConfig, AutoModelForCausalLM

    import tiers
    from tiers.loader.pack import pack

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tiers-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    src, dst, yaml_path = work / "hf", work / "packed", work / "tiers.yaml"

    torch.manual_seed(0)
    kw = dict(DEMO_MODEL)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(src)
    print(f"1. wrote a synthetic {config.model_type} MoE ({config.num_hidden_layers} layers x {config.num_local_experts} experts) to {src}")

    print("2. packing")
    print(pack(src, dst, precisions=["bf16", "int8"], overwrite=True))

    yaml_path.write_text(DEMO_YAML)
    print(f"3. loading through the tiers with {yaml_path}:\n{DEMO_YAML}")
    model = tiers.load(dst, config=yaml_path, device=args.device)
    device = next(model.parameters()).device

    prompt = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    print(f"4. generated {args.tokens} tokens on {device} in {dt:.2f} s: {out[0, prompt.shape[1]:].tolist()}")
    print("5. tier stats:")
    print(tiers.stats(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
