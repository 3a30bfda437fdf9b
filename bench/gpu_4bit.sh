#!/usr/bin/env bash
# The 4-bit precisions on a CUDA machine, in one 10-minute device call; logs and results go to ${OUT:-gpu-out}/.
# Usage (from the repo root): bash bench/gpu_4bit.sh (MODELS, ARMS and BENCH_S narrow steps 2 and 3)
#   1. the CUDA tests of the 4-bit decode (direct kernel against the torch reference, nf4 through bitsandbytes);
#   2. the direct kernel's read rate, from pinned and from GPU memory (experiments/direct4_rate.py --tiles base);
#   3. tools/bench on Qwen3-30B-A3B shapes (12 layers): every expert hot in bf16 against 30% with int4 hot and warm
#      (the arm: every int4 expert fits 30% of the bf16 bytes).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out/results"
source bench/gpu_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/quant 2>&1 | tail -5 | tee "$out/pytest_cuda_quant.log"
timeout 100 python3 experiments/direct4_rate.py --reps 30 --tiles base --models ${MODELS:-qwen3_moe,mixtral} --sources host,dev \
  --out "$out/direct4_rate-base.json" 2>&1 | grep -v Warn | tail -40
timeout ${BENCH_S:-420} python3 tools/bench.py --model qwen3_moe --tokens 32 --reps 3 --interleave 0 --prefill-marks 0 --arms ${ARMS:-tiers_100_bf16,tiers_30_int4_hot} \
  --hf-dir /dev/shm/tiers-hf --out "$out/results" 2>&1 | grep -v '%|' | tail -30
