#!/usr/bin/env bash
# The CUDA-marked tests, then torch.profiler over all-GPU and Tiers arms of both models, on a CUDA
# machine; everything lands in ${OUT:-gpu-out}/ (the profiles as one tarball).
# Usage (from the repo root): bash bench/gpu_profile.sh
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out/profiles"
source bench/gpu_env.sh
timeout 240 python3 -m pytest -m cuda -v -p no:cacheprovider --durations=10 2>&1 | grep -v "^$" > "$out/pytest_cuda.log"
tail -15 "$out/pytest_cuda.log"
timeout 170 python3 bench/profile_arms.py --model mixtral --layers 4 --out "$out/profiles" \
  --trace tiers_100_bf16,tiers_25_int8 --workdir /dev/shm/prof-mixtral 2>&1 | grep -v '%|\|USDT\|^ *$' | tail -8
rm -rf /dev/shm/prof-mixtral
timeout 170 python3 bench/profile_arms.py --model qwen3_moe --layers 6 --arms all_gpu,tiers_100_bf16,tiers_25_int8,tiers_25_bf16 \
  --out "$out/profiles" --trace tiers_25_int8 --workdir /dev/shm/prof-qwen3 2>&1 | grep -v '%|\|USDT\|^ *$' | tail -8
rm -rf /dev/shm/prof-qwen3
tar czf "$out/profiles.tgz" -C "$out" profiles && rm -rf "$out/profiles"
