#!/usr/bin/env bash
# Every GPU check of issues 16, 28 and 35 in one go, under 11 minutes on one H200 (each part under its own time cap),
# ending in one table (bench/gpu/table.py: part, figure, goal, met?):
#   1. BF16 MFU of a ~125M dense model, the bare step compiled: tokens/s, MFU vs 989 TFLOPS (bench/gpu/mfu.py)
#   2. train.py itself on that model and batch, guard and telemetry at their defaults: tokens/s, MFU beside
#      the bare step, host syncs a step under CUDA's sync debug mode (bench/gpu/train.py)
#   3. FP8 vs BF16 over 300 steps at equal loss ±1 %: te_fp8 (Transformer Engine's block scaling where the
#      installed version has it) and fp8_block, step time and eval loss gap (bench/gpu/precision.py)
#   4. MoE grouped GEMM vs the per-expert loop vs a dense twin of equal active FLOPs, bf16 (bench/speed/moe_speed.py)
#   5. the fused FP8 quantiser vs the eager one (issue 28): ms a call, bits equal, cold compile
#      (bench/speed/quant_fused.py)
#   6. the specification checks (spec/) on clean runs of train.py under every recipe: no check fails, each one's
#      worst err/tol (bench/gpu/spec_clean.py)
#   7. the `-m gpu` tests
#
#   bash bench/gpu/all.sh              # on the GPU machine; under $OUT (else bench/out): each part's table (*.md, under
#                                      # bench/report.py's header, as docs/results/ keeps them), its figures (*.json),
#                                      # a log, and gpu_table.md
#   bash bench/gpu/all.sh --dry-run    # on a CPU: every python piece on a tiny problem (checks the code runs)
#
# Without CUDA (and without --dry-run) it prints one line and exits 2. Exit status: 0 when every part ran,
# 1 when one failed or ran out of its time (its log says which); the targets are printed, not enforced.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
PY=${PYTHON:-python}
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "bench/gpu/all.sh: unknown argument '$1' (only --dry-run)" >&2; exit 2 ;;
esac
if [[ $DRY == 0 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "bench/gpu/all.sh: no CUDA GPU here (torch.cuda.is_available() is false); nothing run (--dry-run checks the pieces on the CPU)" >&2
  exit 2
fi
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
RES=${OUT:-bench/out}
mkdir -p "$RES"
LOG="$RES/gpu_all.log"
PARTS="$RES/gpu_parts.tsv"  # name, exit status, seconds, cap: one line a part, for the table
: > "$LOG"
: > "$PARTS"
FAILED=()
T_START=$SECONDS
CAPS=0

part() {  # part NAME CAP_SECONDS CMD...: runs CMD under a time cap, its output to the screen and the log
  local name=$1 cap=$2
  shift 2
  CAPS=$((CAPS + cap))
  echo "=== $name (cap ${cap} s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([[ $rc == 124 ]] && echo ' (time cap reached)')" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$cap" >> "$PARTS"
  [[ $rc == 0 ]] || FAILED+=("$name")
}

"$PY" -m bench.gpu.table --versions 2>&1 | tee -a "$LOG"
uptime | tee -a "$LOG"

if [[ $DRY == 1 ]]; then
  part mfu 300 "$PY" -m bench.gpu.mfu --dry-run --json "$RES/gpu_mfu.json" --out "$RES/gpu_mfu.md"
  part train 300 "$PY" -m bench.gpu.train --dry-run --json "$RES/gpu_train.json" --out "$RES/gpu_train.md"
  part precision 300 "$PY" -m bench.gpu.precision --dry-run --json "$RES/gpu_precision.json" --out "$RES/gpu_precision.md"
  part moe 300 "$PY" -m bench.speed.moe_speed --device cpu --d 64 --batch 2 --seq 32 --steps 2 --threads 1 \
    --no-compile --json "$RES/gpu_moe.json" --out "$RES/gpu_moe.md"
  part quant_fused 300 "$PY" -m bench.speed.quant_fused --device cpu --quick --json "$RES/quant_fused.json" \
    --out "$RES/quant_fused.md"
  part spec 300 "$PY" -m bench.gpu.spec_clean --dry-run --only fp32 --json "$RES/gpu_spec.json" --out "$RES/gpu_spec.md"
  part gpu_tests 300 "$PY" -m pytest -q -n 0 -m gpu tests/test_precision_recipes.py tests/test_precision_quant.py
else
  # The caps (the table's included) sum to 620 s: the 11 minutes less the CUDA check and the device line
  # before the first part (an import of torch each), with margin. What was cut, and why:
  # - mfu: the compiled arm only: train.py is compared with it; the eager arm says only what compile buys.
  # - quant_fused: 5 rounds, not 15: its figures are ratios, and each row's cold compile is the cost.
  # - moe, gpu_tests: eager steps of a 4-layer model, and a handful of small tests: a fraction of the old caps.
  # - precision keeps its 300 steps: the loss-gap goal is defined over them.
  # - train gets the most: two cold compiles (a telemetry step's hooks make a second graph) before its steps.
  # NOTE: batch 64 x 1024, not 32: at 32 the optimizer and clip (per step, not per token) are a few % of
  # a step that MFU counts as idle; past 64 the figure no longer moves
  part mfu 75 "$PY" -m bench.gpu.mfu --arms compiled --steps 20 --batch-size 64 --json "$RES/gpu_mfu.json" \
    --out "$RES/gpu_mfu.md"
  # 50 warm-up steps (the compile, the telemetry graph, the detector's warm-up), 40 timed, 10 counted syncs
  part train 130 "$PY" -m bench.gpu.train --batch-size 64 --json "$RES/gpu_train.json" --out "$RES/gpu_train.md"
  part precision 95 "$PY" -m bench.gpu.precision --steps 300 --batch-size 16 --json "$RES/gpu_precision.json" \
    --out "$RES/gpu_precision.md"
  part moe 30 "$PY" -m bench.speed.moe_speed --device cuda --d 1024 --batch 16 --seq 1024 --steps 20 --no-compile \
    --json "$RES/gpu_moe.json" --out "$RES/gpu_moe.md"
  # NOTE: ten rows, each a Triton compile where its kind, layout or size class is new (cold cache)
  part quant_fused 50 "$PY" -m bench.speed.quant_fused --device cuda --rounds 5 --json "$RES/quant_fused.json" \
    --out "$RES/quant_fused.md"
  # 9 launches of train.py, 24 steps each, a reference step every 2 (one with a cold compile)
  part spec 180 "$PY" -m bench.gpu.spec_clean --steps 24 --json "$RES/gpu_spec.json" --out "$RES/gpu_spec.md"
  # -n 0: in one process, as the timed parts run: one GPU, not a worker per CPU core contending for it
  part gpu_tests 45 "$PY" -m pytest -q -n 0 -m gpu tests/
fi
part table 15 "$PY" -m bench.gpu.table "$RES" --out "$RES/gpu_table.md" $([[ $DRY == 1 ]] && echo --dry-run)

echo "=== gpu_all: $((SECONDS - T_START)) s in all (caps $CAPS s); results in $RES (gpu_table.md; each part's *.md and *.json, gpu_all.log)" | tee -a "$LOG"
if ((${#FAILED[@]})); then
  echo "=== gpu_all: FAILED: ${FAILED[*]}" | tee -a "$LOG"
  exit 1
fi
echo "=== gpu_all: every part ran" | tee -a "$LOG"
