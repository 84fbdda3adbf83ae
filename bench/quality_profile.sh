#!/usr/bin/env bash
# One quality-benchmark run on a GPU machine, followed inside one device call: its progress every 10 s, a py-spy
# profile of the `dflash-train` process once it passes a step, and its logs, all under DEST:
#
#   source bench/device_env.sh            # with py-spy's wheel in .whl/, fetched here by README's device command:
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#           --platform manylinux1_x86_64 -d .whl py-spy==0.4.3
#   bash bench/quality_profile.sh W DEST SECONDS STEP [bench_quality.py flags...]
#
# e.g. `... /tmp/w $OUT/logs 545 400 --target code --size full --codecs fp8 --fractions 1 --seeds 1 --parallel 1`
# (add `--unpack DIR` to start from a packed target and rows, `--pack $OUT/pack` to bring them back, and
# `--deadline S` with several seeds so that no run starts that would not end inside the call).
# DEST gets progress.txt (time, step, phase), spy_raw.txt (30 s at 100 Hz, thread ids, idle frames) and
# spy_gil.txt (the next 30 s, GIL holders only: read both with `python bench/spy_summary.py spy_raw.txt --gil
# spy_gil.txt`), bench.tail (the benchmark's and the run's log tails), each run's metrics-RUN.jsonl, and the
# target's and rows' digests in progress.txt. Ends when the benchmark does, or after SECONDS (leaving the run to
# the end of the call); the two profiles take 60 s once STEP is reached, which may run past SECONDS: leave that
# much of the call's limit free.
set -u
work=${1:?work folder}
dest=${2:?dest folder}
seconds=${3:?seconds}
spy_step=${4:?step to profile at}
shift 4
mkdir -p "$dest" "$work"
start=$SECONDS
python3 bench/bench_quality.py --work "$work" "$@" >"$work/bench.log" 2>&1 &
bench_pid=$!
step_now() { python3 bench/last_step.py "$work" | cut -d ' ' -f 1; }
spied=0
while [ $((SECONDS - start)) -lt "$seconds" ] && kill -0 "$bench_pid" 2>/dev/null; do
  step=$(step_now)
  echo "t=$((SECONDS - start)) step=$step $(grep -E '^\[|^unpacked' "$work/bench.log" | tail -n 1)" >>"$dest/progress.txt"
  if [ $spied = 0 ] && [ "$step" -ge "$spy_step" ]; then
    pid=$(pgrep -f "dflash.train.cli" | head -n 1)
    spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    "$spy" record -p "$pid" -d 30 -r 100 -f raw -t --idle -o "$dest/spy_raw.txt" >"$dest/spy.txt" 2>&1
    "$spy" record -p "$pid" -d 30 -r 100 -f raw -t --gil -o "$dest/spy_gil.txt" >>"$dest/spy.txt" 2>&1
    spied=1
  fi
  sleep 10
done
{
  tail -n 40 "$work/bench.log"
  for log in "$work"/{,prose/,hybrid/}cache-*.log "$work"/{,prose/,hybrid/}runs*/*.log; do
    [ -f "$log" ] && { echo "== $log"; grep -v Warning "$log" | tail -n 30; }
  done
} >"$dest/bench.tail"
# with TORCH_LOGS=recompiles in the environment: which guard failed, and at which step's shapes
# (prose and hybrid work in W/prose and W/hybrid: bench_quality.py's --target)
grep -h -i -A3 "recompil" "$work"/{,prose/,hybrid/}runs*/*.log >"$dest/recompiles.txt" 2>/dev/null
for metrics in "$work"/{,prose/,hybrid/}runs*/*/metrics.jsonl; do
  [ -f "$metrics" ] && cp "$metrics" "$dest/metrics-$(basename "$(dirname "$metrics")").jsonl"
done
for target in "$work" "$work"/prose "$work"/hybrid; do
  [ -d "$target/target" ] && sha256sum "$target"/target/*.safetensors "$target"/data/rows.arrow >>"$dest/progress.txt" 2>&1
done
exit 0
