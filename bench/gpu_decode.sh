#!/usr/bin/env bash
# The 4-bit warm decode against its bytes bound on the H200, in one 10-minute device call; results and logs go to ${OUT:-gpu-out}/.
# Usage (from the repo root): bash bench/gpu_decode.sh (QWEN_ARMS, MIXTRAL_ARMS pick the arms, empty skips; KERNELS=1 profiles them)
#   1. the CUDA tests of the step graphs;
#   2. experiments/host_read.py: this machine's rates from pinned memory, by the copy engine and by the SMs' loads;
#   3. experiments/decode_marks.py on Qwen3-30B-A3B's shapes (12 layers) and Mixtral-8x7B's (8 layers): int4 warm
#      first (before any other arm's graphs), all-hot, int4 warm again, and int4 warm with the step's 12 length
#      counters set by one kernel (~foreach, ~shared) instead of 12 device copies; each arm's launch time, and its
#      bound_ratio, the figure (decode over all-hot's plus its bytes at 55 GB/s).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
source bench/gpu_env.sh
timeout 50 python3 -m pytest -q -p no:cacheprovider -m cuda tests/tiers/graphs 2>&1 | tail -3 | tee "$out/pytest_cuda_graphs.log"
timeout 60 python3 experiments/host_read.py --out "$out/host_read.json" 2>&1 | grep -A8 gb_s
k=${KERNELS:+--kernels}
qa=${QWEN_ARMS-tiers_25_int4,tiers_100_bf16,tiers_25_int4~r2,tiers_25_int4~foreach,tiers_25_int4~shared}
[ -z "$qa" ] || timeout 330 python3 experiments/decode_marks.py --model qwen3_moe --layers 12 --tokens 32 --arms "$qa" $k \
  --out "$out/decode_marks-qwen3.json" > "$out/decode_marks-qwen3.log" 2>&1
grep -v Warn "$out/decode_marks-qwen3.log" | grep "bound\|rror" | cut -c1-300
ma=${MIXTRAL_ARMS-}
[ -z "$ma" ] || timeout 180 python3 experiments/decode_marks.py --model mixtral --layers 8 --tokens 32 --arms "$ma" $k \
  --out "$out/decode_marks-mixtral.json" > "$out/decode_marks-mixtral.log" 2>&1
[ -z "$ma" ] || grep -v Warn "$out/decode_marks-mixtral.log" | grep "bound\|rror" | cut -c1-300
