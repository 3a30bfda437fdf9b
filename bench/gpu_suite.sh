#!/usr/bin/env bash
# The whole test suite plus the demo on a CUDA machine; logs go to ${OUT:-gpu-out}/.
# Usage (from the repo root): bash bench/gpu_suite.sh
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
source bench/gpu_env.sh
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/env.txt"
python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
python3 -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tail -3 | tee "$out/pytest_cuda_only.log"
python3 tools/demo.py --workdir /tmp/tiers-demo 2>&1 | grep -v '%|' | tee "$out/demo.log"
exit "$rc"
