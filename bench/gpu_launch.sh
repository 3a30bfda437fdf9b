#!/usr/bin/env bash
# The step graphs' launch on the H200, in one 10-minute device call; results and logs go to ${OUT:-gpu-out}/.
# Usage (from the repo root): bash bench/gpu_launch.sh (LAUNCH_ARMS, QWEN_ARMS, MIXTRAL_ARMS pick the arms; empty: skip)
#   1. the CUDA tests of the step graphs;
#   2. experiments/graph_launch.py: which kinds of node make a synthetic graph slow to launch;
#   3. experiments/decode_marks.py on Qwen3-30B-A3B's shapes (12 layers) and Mixtral-8x7B's (8 layers): all-hot against
#      4-bit warm, with each step graph's launch time; each arm's bound_ratio is the figure (decode over
#      all-hot's plus its bytes at 55 GB/s).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
source bench/gpu_env.sh
timeout 50 python3 -m pytest -q -p no:cacheprovider -m cuda tests/tiers/graphs 2>&1 | tail -3 | tee "$out/pytest_cuda_graphs.log"
la=${LAUNCH_ARMS-plain,triton,plain/4,plain:225,plain:3600,plain+other,triton1,jiter,cat,mv,h2d,triton~foreach}
[ -z "$la" ] || timeout 60 python3 experiments/graph_launch.py --arms "$la" --out "$out/graph_launch.json" > "$out/graph_launch.log" 2>&1
grep -v Warn "$out/graph_launch.log" | cut -c1-200 | head -20
qa=${QWEN_ARMS-tiers_100_bf16,tiers_25_int4}
[ -z "$qa" ] || timeout 200 python3 experiments/decode_marks.py --model qwen3_moe --layers 12 --tokens 32 --arms "$qa" \
  --out "$out/decode_marks-qwen3-launch.json" > "$out/decode_marks-qwen3.log" 2>&1
grep -v Warn "$out/decode_marks-qwen3.log" | grep "bound\|rror\|launch_ms" | sed 's/.tokens.*launch_ms/ launch_ms/' | cut -c1-300
ma=${MIXTRAL_ARMS-tiers_100_bf16,tiers_25_int4}
[ -z "$ma" ] || timeout 180 python3 experiments/decode_marks.py --model mixtral --layers 8 --tokens 32 --arms "$ma" \
  --out "$out/decode_marks-mixtral-launch.json" > "$out/decode_marks-mixtral.log" 2>&1
[ -z "$ma" ] || grep -v Warn "$out/decode_marks-mixtral.log" | grep "bound\|rror\|launch_ms" | sed 's/.tokens.*launch_ms/ launch_ms/' | cut -c1-300
