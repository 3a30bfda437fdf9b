#!/usr/bin/env bash
# The step graphs' launch on the H200, in one 10-minute device call; results go to ${OUT:-gpu-out}/.
# Usage (from the repo root): bash bench/gpu_launch.sh (SKIP_PROBE=1, SKIP_MIXTRAL=1 leave out steps 2 and 3's Mixtral)
#   1. the CUDA tests of the step graphs;
#   2. experiments/graph_launch.py: a synthetic graph's launch with Triton kernels, its 12 copies as device copies,
#      as one foreach kernel or left out;
#   3. experiments/decode_marks.py on Qwen3-30B-A3B's shapes (12 layers) and Mixtral-8x7B's (8 layers): all-hot against
#      4-bit warm, and int4 warm with the step's length counters set by a device copy per layer as before (~memcpy);
#      each arm's bound_ratio is the figure (decode over all-hot's plus its bytes at 55 GB/s).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
source bench/gpu_env.sh
timeout 50 python3 -m pytest -q -p no:cacheprovider -m cuda tests/tiers/graphs 2>&1 | tail -3 | tee "$out/pytest_cuda_graphs.log"
[ -n "${SKIP_PROBE:-}" ] || timeout 35 python3 experiments/graph_launch.py --arms plain,triton,triton~none,triton~foreach,plain~foreach --out "$out/graph_launch.json" 2>&1 | grep -v Warn | cut -c1-200 | head -13
timeout 150 python3 experiments/decode_marks.py --model qwen3_moe --layers 12 --tokens 32 \
  --arms tiers_100_bf16,tiers_25_int4,tiers_25_int4~memcpy,tiers_25_nf4 \
  --out "$out/decode_marks-qwen3-lengths.json" 2>&1 | grep -v Warn | grep "bound\|rror" | cut -c1-300
[ -n "${SKIP_MIXTRAL:-}" ] || timeout 180 python3 experiments/decode_marks.py --model mixtral --layers 8 --tokens 32 \
  --arms tiers_100_bf16,tiers_25_int4,tiers_25_int4~memcpy \
  --out "$out/decode_marks-mixtral-lengths.json" 2>&1 | grep -v Warn | grep "bound\|rror" | cut -c1-300
