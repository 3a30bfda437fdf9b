#!/usr/bin/env bash
# The 4-bit precisions on a CUDA machine, in one 10-minute device call; logs and results go to ${OUT:-gpu-out}/.
# Usage (from the repo root): bash bench/gpu_4bit.sh (MODEL, ARMS, BENCH_S and RATES narrow the steps)
#   1. the CUDA tests of the 4-bit decode, the fused int4 products and staging (kernels against the torch references);
#      the rest only where they pass;
#   2. the probes of RATES (default fused4): experiments/fused4_rate.py (fused products against slot decode),
#      direct4: experiments/direct4_rate.py --tiles base (direct decode from pinned and GPU memory);
#   3. tools/bench on MODEL's shapes (default qwen3_moe, 12 layers; mixtral: 8): every expert hot in bf16 against
#      30% with int4 hot (the arm: every int4 expert fits 30% of the bf16 bytes).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out/results"
source bench/gpu_env.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/quant/test_fused4.py tests/quant/test_direct4.py \
  tests/quant/test_direct_fetch.py tests/tiers/test_quantized_hot.py tests/tiers/transfer 2>&1 | tail -5 | tee "$out/pytest_cuda_4bit.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "the CUDA tests failed: no probes, no bench"; exit 1; }
for rate in ${RATES-fused4}; do
  case $rate in
    fused4) timeout 120 python3 experiments/fused4_rate.py --reps 30 --out "$out/fused4_rate.json" 2>&1 | grep -v Warn | tail -30 ;;
    direct4) timeout 100 python3 experiments/direct4_rate.py --reps 30 --tiles base --models qwen3_moe,mixtral --sources host,dev \
      --out "$out/direct4_rate-base.json" 2>&1 | grep -v Warn | tail -40 ;;
  esac
done
timeout ${BENCH_S:-420} python3 tools/bench.py --model ${MODEL:-qwen3_moe} --tokens 32 --reps 3 --interleave 0 --prefill-marks 0 \
  --arms ${ARMS:-tiers_100_bf16,tiers_30_int4_hot} --hf-dir /dev/shm/tiers-hf --out "$out/results" 2>&1 | grep -v '%|' | tail -30
