#!/usr/bin/env bash
# Training speed of a quality-benchmark recipe at several pack sizes (token budgets), inside one device call:
#
#   source bench/device_env.sh
#   bash bench/pack_sweep.sh W DEST SECONDS "8192 16384 32768" [bench_quality.py flags...]
#
# e.g. `... /tmp/w $OUT/logs 200 "8192 16384" --target code --size full --codecs fp8 --unpack .qc` (120 s a budget
# ended before a steady rate: start-up and two FlexAttention recompiles take ~60-75 s). The sweep's own
# --train-args (the budget) replace any given here.
# Extracts the cache once (`--stop-after extract`), then trains each budget alone for SECONDS (the run is
# stopped there: speed, not a drafter) under TORCH_LOGS=recompiles, the Inductor cache shared, so a later
# budget starts warm. DEST gets sweep.txt (budget, seconds, step, every 5 s), gpu.txt (nvidia-smi every 5 s),
# one log tail per budget, and `python bench/pack_sweep_summary.py DEST` prints steps/s and tokens/s.
set -u
work=${1:?work folder}
dest=${2:?dest folder}
seconds=${3:?seconds per budget}
budgets=${4:?token budgets}
shift 4
mkdir -p "$dest" "$work"
export TORCHINDUCTOR_CACHE_DIR="$work/inductor"
start=$SECONDS
python3 bench/bench_quality.py --work "$work" "$@" --stop-after extract >"$work/extract.log" 2>&1
echo "extract $((SECONDS - start)) s" >>"$dest/sweep.txt"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 5 >"$dest/gpu.txt" 2>&1 &
smi=$!
for budget in $budgets; do
  runs="runs-$budget"
  t0=$SECONDS
  echo "budget $budget starts at $((t0 - start)) s" >>"$dest/sweep.txt"
  TORCH_LOGS=recompiles timeout -s INT "$seconds" python3 bench/bench_quality.py --work "$work" "$@" \
    --fractions 1 --seeds 1 --parallel 1 --runs-dir "$runs" \
    --train-args "--token-budget $budget --max-length $budget --eval-every 100000" >"$work/$runs.log" 2>&1 &
  run=$!
  while [ $((SECONDS - t0)) -lt "$seconds" ]; do
    echo "$budget $((SECONDS - t0)) $(python3 bench/last_step.py "$work/$runs")" >>"$dest/sweep.txt"
    sleep 5
  done
  wait "$run"
  for log in "$work/$runs"/*.log; do
    [ -f "$log" ] && { echo "== $log"; grep -v Warning "$log" | tail -n 40; }
  done >"$dest/tail-$budget.txt"
done
kill "$smi" 2>/dev/null
exit 0
