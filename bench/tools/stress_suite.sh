#!/usr/bin/env bash
# The test suite on a busy machine: CPU hogs occupy the cores while pytest runs; the suite must pass.
#
#   bash bench/tools/stress_suite.sh                         # the default suite (python -m pytest -q)
#   bash bench/tools/stress_suite.sh tests/test_doctor.py    # any pytest arguments instead
#   STRESS_HOGS=4 STRESS_MAX_S=1800 bash bench/tools/stress_suite.sh
#
# STRESS_HOGS busy-loop processes (default: one per online core; not `nproc`, which obeys
# OMP_NUM_THREADS) start before pytest and are killed when it
# ends (a trap, also on Ctrl-C or a failure); each is also bounded by STRESS_MAX_S seconds of wall time
# (default 3600), so none can outlive a killed script. Prints pytest's summary, the wall time and the
# load average, and exits with pytest's status.
set -u
cd "$(dirname "$0")/../.."

HOGS=${STRESS_HOGS:-$(getconf _NPROCESSORS_ONLN)}
MAX_S=${STRESS_MAX_S:-3600}
PY=${PYTHON:-python}
pids=()

stop_hogs() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null
    done
    pids=()
}
trap stop_hogs EXIT
trap 'stop_hogs; exit 130' INT TERM

for _ in $(seq "$HOGS"); do
    # NOTE: `timeout` bounds the hog even if this script is SIGKILLed (no trap runs then)
    timeout "$MAX_S" "$PY" -c "while True: pass" &
    pids+=("$!")
done
echo "stress: ${#pids[@]} CPU hog(s) on $(getconf _NPROCESSORS_ONLN) core(s), at most ${MAX_S} s; load $(cut -d' ' -f1-3 /proc/loadavg)"

t0=$(date +%s)
if [ $# -eq 0 ]; then
    set -- -q
fi
"$PY" -m pytest "$@"
rc=$?
echo "stress: pytest exit $rc after $(( $(date +%s) - t0 )) s under ${#pids[@]} hog(s); load $(cut -d' ' -f1-3 /proc/loadavg)"
exit $rc
