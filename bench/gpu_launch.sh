#!/usr/bin/env bash
# The step-graph launch fixes for Qwen3's 4-bit warm decode, in one 10-minute device call; results go to ${OUT:-gpu-out}/.
# Usage (from the repo root): bash bench/gpu_launch.sh
#   1. experiments/graph_launch.py: a synthetic graph's launch with Triton kernels loaded each way, whole and in 4 parts;
#   2. experiments/decode_marks.py on Qwen3-30B-A3B's shapes (12 layers): all-hot against int4 warm as it is, with its
#      step graphs in parts (~parts) and with its kernels loaded as a library (~library); each arm's bound_ratio is the
#      issue's figure (decode over all-hot's plus its bytes at 55 GB/s).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
source bench/gpu_env.sh
timeout 120 python3 experiments/graph_launch.py --out "$out/graph_launch.json" 2>&1 | grep -v Warn | tail -14
timeout 440 python3 experiments/decode_marks.py --model qwen3_moe --layers 12 --tokens 32 \
  --arms tiers_100_bf16,tiers_25_int4,tiers_25_int4~parts,tiers_25_int4~library,tiers_100_bf16~parts \
  --out "$out/decode_marks-qwen3-variants.json" 2>&1 | grep -v Warn | cut -c1-400 | tail -12
