#!/usr/bin/env bash
# Time to nanoGPT's final val loss (1.8857): nanoGPT's README CPU command against ballast's speedrun recipe
# (conf/experiment/speedrun.yaml), alternated on this machine (ABBA over rounds), then bench/speed/speedrun.py.
#   NANOGPT_DIR=/path/to/nanoGPT bash bench/speed/speedrun.sh [rounds=2] [ballast overrides...]
# NANOGPT_DIR: a karpathy/nanoGPT checkout (3adf61e), never part of this repository; its shakespeare_char
# data is prepared by its own prepare.py from $DATA (copied to the input.txt it expects: no download).
# THREADS (default 1) sets both processes' intra-op threads: on a shared machine one thread per process
# keeps both sides' step times steady; `uptime` is logged beside every run.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${NANOGPT_DIR:?set NANOGPT_DIR to a karpathy/nanoGPT checkout}"
data=$(realpath "${DATA:-${TINYSHAKESPEARE:?set TINYSHAKESPEARE to the path of tinyshakespeare.txt (README: Running)}}")
threads=${THREADS:-1}
rounds=${1:-2}
shift || true
out=$(pwd)/runs/speedrun-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
export OMP_NUM_THREADS=$threads HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
prep=$NANOGPT_DIR/data/shakespeare_char
if [ ! -f "$prep/train.bin" ]; then
  cp "$data" "$prep/input.txt"
  (cd "$NANOGPT_DIR" && python data/shakespeare_char/prepare.py)
fi
for r in $(seq 1 "$rounds"); do
  order="nanogpt ballast"
  [ $((r % 2)) -eq 0 ] && order="ballast nanogpt"
  for who in $order; do
    uptime > "$out/$who-$r.uptime"
    echo "round $r: $who ($(uptime | sed 's/.*load/load/'))"
    if [ "$who" = nanogpt ]; then
      (cd "$NANOGPT_DIR" && python train.py config/train_shakespeare_char.py --device=cpu --compile=False \
        --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 \
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --out_dir="$out/nanogpt-$r") > "$out/nanogpt-$r.log" 2>&1
    else
      python train.py +experiment=speedrun "data.path=$data" "hydra.run.dir=$out/ballast-$r" "threads=$threads" \
        logging.wandb=disabled logging.progress=false "$@" > "$out/ballast-$r.log" 2>&1
    fi
    uptime >> "$out/$who-$r.uptime"
  done
done
python -m bench.speed.speedrun "$out"
