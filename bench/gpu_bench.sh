#!/usr/bin/env bash
# The benchmark runs behind bench/results, on a CUDA machine; results go to ${OUT:-gpu-out}/results.
# Usage (from the repo root): bash bench/gpu_bench.sh [mixtral|qwen3_moe|all]  (one model fits one 10-minute device call;
# Mixtral's run 42, these flags under a 495 s limit after the CUDA suite in the same call, on a slow host, stopped after
# its last arm, before its copy sweep and cold reads: python3 tools/bench.py --report <out>/bench-mixtral.partial.json
# writes the tables and the plot of such a run)
# Each model: all-GPU, naive lazy, accelerate and Tiers arms, uniform and skewed routing, in one run,
# with the flags of the latest complete runs (bench/results/bench-qwen3_moe-run60.md, -mixtral-run48.md: 391 s and
# 507 s of the call).
set -uo pipefail
out=${OUT:-gpu-out}/results
mkdir -p "$out"
source bench/gpu_env.sh
arms=all_gpu,all_gpu@skewed,lazy,accelerate,tiers_100_bf16,tiers_0_int8,tiers_25_int8,tiers_50_int8,tiers_25_bf16,tiers_50_bf16,tiers_100_bf16@skewed,tiers_25_int8@skewed,tiers_50_int8@skewed,tiers_25_int8@skewed_norebal
hf=/dev/shm/tiers-hf  # the save_pretrained checkpoint before packing: tmpfs, the disk holds the pack
rc=0
for model in ${1:-all}; do
  case $model in all) models="mixtral qwen3_moe" ;; *) models=$model ;; esac
  for m in $models; do
    case $m in
      # Qwen3: decode ~16 ms/token, six repetitions fit. The rebalancer's warm-up is 768 tokens: at 4
      # moves a round the 25% hot set still promoted at that cap 128 tokens after a warm-up of 256
      # (bench-qwen3_moe-rebalance-settling.json, pruned; in the tree of commit 5faf981) and settled
      # after about 450 (run 53); at 8, the default since, after about 250 (runs 54 and 55). The 0%
      # arm is left out to make room
      qwen3_moe) flags="--tokens 32 --reps 6 --rebalance-warmup 768" run_arms=${arms/,tiers_0_int8/} ;;
      *) flags="--tokens 16 --reps 2 --rebalance-warmup 128" run_arms=$arms ;;  # Mixtral's slow arms take most of the call
    esac
    timeout 585 python3 tools/bench.py --model "$m" $flags --slow-tokens 2 --prefill-marks 3 --arms "$run_arms" --copy-sweep --cold-read-gb 1 \
      --hf-dir "$hf" --out "$out" 2>&1 | grep -v '%|' | tail -30 || rc=1
    rm -rf "$hf" /tmp/tiers-bench-*
  done
done
exit "$rc"
