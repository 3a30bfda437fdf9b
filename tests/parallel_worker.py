"""One rank of an expert-parallel test run (started by tests/tiers/test_parallel.py, one process a rank).

    python tests/parallel_worker.py RANK WORLD BACKEND RENDEZVOUS OUT CASES_JSON

Joins the group (gloo or nccl, a 60 s timeout), then for each case of CASES_JSON (a packed path
and a config) loads it with ``tiers.parallel.experts``, and records the prefill logits, greedy
tokens, its own and the summed stats; a load that raises records the message. Writes OUT (torch.save),
waits for every rank, leaves the group, and exits at once, skipping interpreter finalization,
in which gloo's threads can abort a process that has finished its work (pytorch/pytorch#179291).
CI once saw a rank here abort (SIGABRT, "terminate called without an active exception") with no
Python stack; faulthandler now prints one, and a crash before OUT is written still fails the test.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

PROMPT = [[5, 17, 42, 9, 100, 3, 77, 21]]


def run_case(case: dict, device: torch.device) -> dict:
    import tiers

    try:
        model = tiers.load(case["path"], case["config"], device=device, progress=False)
    except Exception as e:  # noqa: BLE001 (the test reads the message every rank raised)
        return {"error": f"{type(e).__name__}: {e}"}
    ids = torch.tensor(PROMPT, device=device)
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    tokens = model.generate(ids, max_new_tokens=case.get("tokens", 6), do_sample=False).cpu()
    mine = tiers.stats(model).as_dict()
    total = tiers.stats(model, all_ranks=True).as_dict()
    runtime = tiers.manifest(model)
    return {"logits": logits, "tokens": tokens, "stats": mine, "all_ranks": total, "parallel": runtime["parallel"],
            "experts": [(e["layer"], e["expert"]) for e in runtime["experts"]]}


def main() -> int:
    faulthandler.enable()
    rank, world, backend, rendezvous, out, cases = sys.argv[1:7]
    rank, world = int(rank), int(world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        torch.save([run_case(case, device) for case in json.loads(cases)[rank]], out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
