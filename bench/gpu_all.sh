#!/usr/bin/env bash
# Every GPU check of issue 16 in one go, within 10 minutes on one H200 (each part under its own time cap):
#   1. BF16 MFU of a ~125M dense model, eager and compiled: tokens/s, MFU vs 989 TFLOPS (bench/gpu_mfu.py)
#   2. FP8 vs BF16 over 300 steps at equal loss ±1 %: te_fp8 (Transformer Engine's block scaling where the
#      installed version has it) and fp8_block, step time and eval loss gap (bench/gpu_precision.py)
#   3. MoE grouped GEMM vs the per-expert loop vs a dense twin of equal active FLOPs, bf16 (bench/moe_speed.py)
#   4. the fused FP8 quantiser vs the eager one (issue 28): ms a call, bits equal, cold compile (bench/quant_fused.py)
#   5. the `-m gpu` tests
#
#   bash bench/gpu_all.sh              # on the GPU machine; results (gpu_*.md, as docs/results/ keeps them) and a log under $OUT (else bench/out)
#   bash bench/gpu_all.sh --dry-run    # on a CPU: every python piece on a tiny problem (checks the code runs)
#
# Without CUDA (and without --dry-run) it prints one line and exits 2. Exit status: 0 when every part ran,
# 1 when one failed or ran out of its time (its log says which); the targets are printed, not enforced.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python}
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "bench/gpu_all.sh: unknown argument '$1' (only --dry-run)" >&2; exit 2 ;;
esac
if [[ $DRY == 0 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "bench/gpu_all.sh: no CUDA GPU here (torch.cuda.is_available() is false); nothing run (--dry-run checks the pieces on the CPU)" >&2
  exit 2
fi
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
RES=${OUT:-bench/out}
mkdir -p "$RES"
LOG="$RES/gpu_all.log"
: > "$LOG"
FAILED=()
T_START=$SECONDS

part() {  # part NAME CAP_SECONDS CMD...: runs CMD under a time cap, its output to the screen and the log
  local name=$1 cap=$2
  shift 2
  echo "=== $name (cap ${cap} s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([[ $rc == 124 ]] && echo ' (time cap reached)')" | tee -a "$LOG"
  [[ $rc == 0 ]] || FAILED+=("$name")
}

"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA (dry run)"
try:
    import transformer_engine as te
    te_v = te.__version__
except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
    te_v = f"not importable ({type(e).__name__})"
print(f"device {dev} | torch {torch.__version__} | CUDA {torch.version.cuda} | Transformer Engine {te_v}")
EOF
uptime | tee -a "$LOG"

if [[ $DRY == 1 ]]; then
  part mfu 300 "$PY" -m bench.gpu_mfu --dry-run --json "$RES/gpu_mfu.json" --out "$RES/gpu_mfu.md"
  part precision 300 "$PY" -m bench.gpu_precision --dry-run --json "$RES/gpu_precision.json" --out "$RES/gpu_precision.md"
  part moe 300 "$PY" -m bench.moe_speed --device cpu --d 64 --batch 2 --seq 32 --steps 2 --threads 1 --no-compile --out "$RES/gpu_moe.md"
  part quant_fused 300 "$PY" -m bench.quant_fused --device cpu --quick --out "$RES/quant_fused.md"
  part gpu_tests 300 "$PY" -m pytest -q -m gpu tests/test_precision_recipes.py tests/test_precision_quant.py
else
  # caps sum to 560 s: the 10 minutes, with the start-up and the device line
  # NOTE: batch 64 x 1024, not 32: at 32 the optimizer and clip (per step, not per token) are a few % of
  # a step that MFU counts as idle; past 64 the figure no longer moves
  part mfu 150 "$PY" -m bench.gpu_mfu --steps 20 --batch-size 64 --json "$RES/gpu_mfu.json" --out "$RES/gpu_mfu.md"
  part precision 180 "$PY" -m bench.gpu_precision --steps 300 --batch-size 16 --json "$RES/gpu_precision.json" --out "$RES/gpu_precision.md"
  part moe 60 "$PY" -m bench.moe_speed --device cuda --d 1024 --batch 16 --seq 1024 --steps 20 --no-compile --out "$RES/gpu_moe.md"
  # NOTE: ten rows, each a Triton compile where its kind, layout or size class is new (cold cache)
  part quant_fused 90 "$PY" -m bench.quant_fused --device cuda --out "$RES/quant_fused.md"
  part gpu_tests 80 "$PY" -m pytest -q -m gpu tests/
fi

echo "=== gpu_all: $((SECONDS - T_START)) s in all; results in $RES (gpu_*.md: docs/results/ material; gpu_*.json, gpu_all.log)" | tee -a "$LOG"
if ((${#FAILED[@]})); then
  echo "=== gpu_all: FAILED: ${FAILED[*]}" | tee -a "$LOG"
  exit 1
fi
echo "=== gpu_all: every part ran" | tee -a "$LOG"
