#!/usr/bin/env bash
# Time to nanoGPT's final val loss (1.8857), side by side with nanoGPT itself, and the table that says it:
#   NANOGPT_DIR=/path/to/nanoGPT TINYSHAKESPEARE=/path/to/tinyshakespeare.txt bash bench/speed/speedrun.sh [seeds=5] [--out FILE]
# Round i (seeds 0..N-1; the order of the three runs rotates every round, `uptime` logged beside each):
#   nanoGPT  its README CPU command (eager, 2000 iterations): the same numbers every run, a new timing each round
#   speedrun python train.py +experiment=speedrun seed=i           (ballast's recipe: conf/experiment/speedrun.yaml),
#            evaluated every 5 steps: its crossing to ±2 steps (the recipe's every 25 rounds it up by 12 on average)
#   shape    python train.py +experiment=shakespeare_char seed=i   (nanoGPT's own recipe shape; train.compile as the
#            run decides it: eager on a CPU), stopped at step 1000 and evaluated every 25 steps, for its crossing
# then one compiled run of the shape (train.compile=true, 30 steps) for the cold start, with an empty Inductor cache of
# its own (TORCHINDUCTOR_CACHE_DIR, removed after: the machine's cache from earlier compiles would make it a warm
# start), and bench/speed/speedrun.py's
# table (--out writes it under bench/report.py's header; docs/results/speedrun.md is this command's output).
# NANOGPT_DIR: a karpathy/nanoGPT checkout (3adf61e), never part of this repository; its shakespeare_char data is
# prepared by its own prepare.py from the local text (copied to the input.txt it expects: no download).
# Clock: nanoGPT runs with its time.time read as process CPU time (CLOCK=cpu, the default), the clock ballast's
# StepRecord keeps beside the wall time: one thread per process, so CPU time is each step's own compute, which
# neighbours on a shared machine move far less than wall time. CLOCK=wall leaves nanoGPT's clock alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${NANOGPT_DIR:?set NANOGPT_DIR to a karpathy/nanoGPT checkout}"
data=$(realpath "${DATA:-${TINYSHAKESPEARE:?set TINYSHAKESPEARE to the path of tinyshakespeare.txt (README: Running)}}")
seeds=${1:-5}
shift || true
clock=${CLOCK:-cpu}
out=$(pwd)/runs/speedrun-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
echo "$clock" > "$out/clock"
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
prep=$NANOGPT_DIR/data/shakespeare_char
if [ ! -f "$prep/train.bin" ]; then
  cp "$data" "$prep/input.txt"
  (cd "$NANOGPT_DIR" && python data/shakespeare_char/prepare.py)
fi
quiet=(threads=1 logging.wandb=disabled logging.progress=false logging.plot=false checkpoint.every=0)
run() {  # who seed
  local who=$1 i=$2
  uptime > "$out/$who-$i.uptime"
  echo "round $i: $who ($(uptime | sed 's/.*load/load/'))"
  case $who in
    nanogpt)
      local patch=""
      [ "$clock" = cpu ] && patch="time.time = time.process_time; "
      (cd "$NANOGPT_DIR" && python -c "import runpy, sys, time; ${patch}sys.argv = sys.argv[1:]; \
runpy.run_path('train.py', run_name='__main__')" train.py config/train_shakespeare_char.py --device=cpu \
        --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 \
        --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --out_dir="$out/nanogpt-$i") \
        > "$out/nanogpt-$i.log" 2>&1 ;;
    speedrun)
      python train.py +experiment=speedrun "data.path=$data" "hydra.run.dir=$out/speedrun-$i" "seed=$i" \
        train.eval_every=5 "${quiet[@]}" > "$out/speedrun-$i.log" 2>&1 ;;
    shape)
      python train.py +experiment=shakespeare_char "data.path=$data" "hydra.run.dir=$out/shape-$i" "seed=$i" \
        checkpoint.stop_after=1000 train.eval_every=25 "${quiet[@]}" > "$out/shape-$i.log" 2>&1 ;;
  esac
  uptime >> "$out/$who-$i.uptime"
}
whos=(nanogpt speedrun shape)
for i in $(seq 0 $((seeds - 1))); do
  k=$((i % 3))
  for who in "${whos[@]:$k}" "${whos[@]:0:$k}"; do run "$who" "$i"; done
done
uptime > "$out/compiled.uptime"
cache=$(mktemp -d)
TORCHINDUCTOR_CACHE_DIR=$cache python train.py +experiment=shakespeare_char "data.path=$data" \
  "hydra.run.dir=$out/compiled" train.compile=true checkpoint.stop_after=30 train.eval_every=1000000 "${quiet[@]}" \
  > "$out/compiled.log" 2>&1
rm -rf "$cache"
uptime >> "$out/compiled.uptime"
python -m bench.speed.speedrun "$out" "$@"
