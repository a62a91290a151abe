#!/usr/bin/env bash
# The issue's anchor benchmark: shakespeare_char, 4 layers × 4 heads × width 128, context 64, batch 12,
# lr 1e-3 → 1e-4 cosine (100 warm-up), wd 0.1, clip 1.0, β2 0.99, 2000 steps, StepRecord on.
# Anchor (nanoGPT, same configuration, these 2 cores): val 1.886, median 62.7 ms/step ≈ 12.3k tokens/s.
#   bash bench/speed/shakespeare_char.sh [path/to/tinyshakespeare.txt] [extra overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${1:-${TINYSHAKESPEARE:?set TINYSHAKESPEARE to the path of tinyshakespeare.txt (README: Running), or pass the path}}
shift || true
dir=runs/bench-shakespeare-$(date +%Y%m%d-%H%M%S)
python train.py +experiment=shakespeare_char "data.path=$data" "hydra.run.dir=$dir" logging.wandb=disabled \
  logging.progress=false "$@"
python -m bench.tools.run_summary "$dir"
