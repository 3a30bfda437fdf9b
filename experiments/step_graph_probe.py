"""Can transformers' whole decode step be captured as one CUDA graph, and what would it save?

    python experiments/step_graph_probe.py [--models qwen3_moe,mixtral] [--layers 12,8] [--tokens 32] --out FILE

For each model (random weights, real shapes, every expert on the GPU, batch 1) this times:

- ``dynamic``: ``generate`` as users call it (its default dynamic cache), ms per decode token;
- ``static_generate``: ``generate`` with ``cache_implementation="static"`` and compilation off;
- ``static_eager``: a hand loop of one-token forwards over a ``StaticCache`` (greedy);
- ``static_graph``: the same loop with the forward captured once as a CUDA graph and replayed,
  its inputs (token, position) copied into static buffers.

It checks that the graph's logits equal the eager static loop's bit for bit at every step, and
records which transformers version ran, whether ``generate``'s static caches land at the same
addresses call after call (what a captured step would hold), how long the capture took, and a
2048-token prefill through ``generate`` with either cache. Why: batch-1 decode at
Qwen3-30B-A3B's sizes is bound by the host's Python (``decode_split.py``); a step replayed as one
graph would take that out of every arm alike. CUDA only.
"""
import os
import sys

if __name__ == "__main__":  # run as a script: import the repo's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

from tiers.tools.measure import SHAPES, build, write_result  # noqa: E402


def per_token(fn, tokens: int, reps: int) -> float:
    """Milliseconds per decode token: (fn(1 + tokens) - fn(1)) / tokens, the fastest of ``reps``."""
    def once(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    once(1 + tokens)
    return min(once(1 + tokens) - once(1) for _ in range(reps)) * 1e3 / tokens


def _static_generate(model, prompt, gen, g, kw: dict, tokens: int, reps: int) -> dict:
    """generate with transformers' static cache: per token, whether the cache is kept across
    generates at one address, and a 2048-token prefill against the dynamic cache's."""
    dev = torch.device("cuda")
    res = {}
    static = dict(cache_implementation="static", disable_compile=True)
    try:
        res["static_generate_ms"] = per_token(lambda n: gen(n, **static), tokens, reps)
        caches = []
        for _ in range(2):
            with torch.inference_mode():
                out = model.generate(prompt, max_new_tokens=4, **kw, **static, return_dict_in_generate=True)
            pkv = out.past_key_values
            caches.append(pkv.layers[0].keys.data_ptr() if getattr(pkv, "layers", None) else None)
        res["static_cache_kept_when_returned"] = caches[0] is not None and caches[0] == caches[1]
        seen = []  # the static cache's first key tensor, seen by a hook at each generate's first decode step

        def hook(mod, args, kwargs):
            pkv = kwargs.get("past_key_values")
            if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1 and getattr(pkv, "layers", None):
                seen.append(pkv.layers[0].keys.data_ptr())
        h = model.register_forward_pre_hook(hook, with_kwargs=True)
        for _ in range(3):
            gen(2, **static)
        h.remove()
        res["static_cache_address_repeats"] = len(set(seen)) == 1 and len(seen) == 3
        long = torch.randint(0, model.config.vocab_size, (1, 2048), generator=g).to(dev)

        def prefill_s(**extra):
            with torch.inference_mode():
                model.generate(long, max_new_tokens=1, **kw, **extra)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(reps + 2):
                t = time.perf_counter()
                with torch.inference_mode():
                    model.generate(long, max_new_tokens=1, **kw, **extra)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            return best * 1e3
        res["prefill_2048_dynamic_ms"] = prefill_s()
        res["prefill_2048_static_ms"] = prefill_s(**static)
        res["prefill_2048_dynamic_again_ms"] = prefill_s()
        res["static_generate_tokens_equal_dynamic"] = torch.equal(gen(tokens, **static), gen(tokens))
    except Exception:
        res["static_generate_error"] = traceback.format_exc()[-2000:]
    return res


def probe(model_type: str, layers: int, tokens: int, reps: int) -> dict:
    from transformers import StaticCache

    dev = torch.device("cuda")
    model = build(model_type, dict(SHAPES[model_type], layers=layers), dev)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=g).to(dev)
    res = {"layers": layers}
    kw = dict(do_sample=False, pad_token_id=0)

    def gen(n, **extra):
        with torch.inference_mode():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw, **extra)

    res["dynamic_ms"] = per_token(gen, tokens, reps)
    res.update(_static_generate(model, prompt, gen, g, kw, tokens, reps))
    max_len = 32 + tokens + 8
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)

    def step():
        return model(input_ids=ids, position_ids=pos.view(1, 1), cache_position=pos, past_key_values=cache,
                     use_cache=True, logits_to_keep=1).logits

    def prefill():
        with torch.inference_mode():
            cache.reset()
            out = model(input_ids=prompt, cache_position=torch.arange(32, device=dev), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        return out.logits[:, -1].argmax(-1)

    def loop(n, run):
        tok = prefill()
        logits = []
        with torch.inference_mode():
            for i in range(n - 1):
                ids.copy_(tok.view(1, 1))
                pos.fill_(32 + i)
                out = run()
                logits.append(out[:, -1].float().clone() if record else None)
                tok = out[:, -1].argmax(-1)
        return logits

    record = False
    res["static_eager_ms"] = per_token(lambda n: loop(n, step), tokens, reps)
    record = True
    eager_logits = loop(1 + tokens, step)
    record = False
    try:
        prefill()
        ids.fill_(1)
        pos.fill_(32)
        with torch.inference_mode():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.cuda.graph(graph):
                static_out = step()
            torch.cuda.synchronize()
            res["capture_ms"] = (time.perf_counter() - t) * 1e3

        def replay():
            graph.replay()
            return static_out

        res["static_graph_ms"] = per_token(lambda n: loop(n, replay), tokens, reps)
        record = True
        graph_logits = loop(1 + tokens, replay)
        res["graph_equal_eager_static"] = all(torch.equal(a, b) for a, b in zip(eager_logits, graph_logits))
        res["graph_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(eager_logits, graph_logits))
    except Exception:
        res["static_graph_error"] = traceback.format_exc()[-3000:]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3_moe,mixtral")
    ap.add_argument("--layers", default="12,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import transformers

    result = {"command": "python experiments/step_graph_probe.py " + " ".join(sys.argv[1:]),
              "transformers": transformers.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "models": {}}
    for m, n in zip(args.models.split(","), (int(x) for x in args.layers.split(","))):
        result["models"][m] = probe(m, n, args.tokens, args.reps)
        torch.cuda.empty_cache()
        print(m, {k: v for k, v in result["models"][m].items() if not k.endswith("error")}, flush=True)
        for k, v in result["models"][m].items():
            if k.endswith("error"):
                print(k, v, flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
