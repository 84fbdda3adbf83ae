#!/usr/bin/env bash
# Every quality-benchmark target side by side on one GPU machine, detached, so that a rationed machine's
# later calls can follow the runs and collect their reports (each call may be cut at its time limit):
#
#   bash bench/quality_targets.sh start W "code prose hybrid" [bench_quality.py flags...]
#   bash bench/quality_targets.sh poll W SECONDS [DEST]   # progress every 30 s; reports copied to DEST
#
# `start` runs `bench/bench_quality.py --target T --work W/T FLAGS` for each target T under setsid (its log:
# W/T.log, ending in `== exit CODE`); `start` again with other targets and flags adds to the same W. `poll`
# prints each target's phase and each run's last metrics line every 30 s until every target's run has ended or
# SECONDS pass, and each time copies into DEST each target's quality.json (T-quality.json, once its report is
# written) and one text file (T.log.tail): the tails of its log and of its extractions' logs, then every
# evaluation its runs logged (one metrics line per evaluation, after the run's name). Two files per target: a
# device call (8 files back) polls all three targets and keeps two files of its own. Give `poll` less than the
# call's limit minus its start (a call's output held in a pipe is lost when the limit kills it; DEST is not).
# `poll` on a machine with no logs under W (not the one that ran `start`) ends at once with status 3. Pack parts
# in W/pack (`start ... --pack W/pack`) are copied into DEST too: a build that outlasts one call (the hybrid
# target's, `--stop-after data`) comes back with the call that polls it to its end.
# Runs side by side time-slice the GPU; `source bench/cuda_mps.sh W/mps` before `start` lets their kernels share it.
# Two of three sessions' second calls landed on a fresh machine (BENCHMARKS.md, 2026-12-04): runs that outlast
# one call are lost as often as not; plan them to fit one (`bench/quality_profile.sh` follows one inside a call).
set -u
cmd=${1:?start or poll}
work=${2:?work folder}
case "$cmd" in
start)
  targets=${3:?targets}
  shift 3
  mkdir -p "$work"
  for t in $targets; do
    # the log's last line says the run ended and how (`poll` stops when every target's log has it)
    setsid nohup bash -c 'python3 bench/bench_quality.py "$@"; echo "== exit $?"' _ \
      --target "$t" --work "$work/$t" "$@" >"$work/$t.log" 2>&1 &
    echo "started $t (log $work/$t.log)"
  done
  ;;
poll)
  seconds=${3:?seconds}
  dest=${4:-}
  end=$((SECONDS + seconds))
  # A call that lands on a fresh machine (the one that started the runs went back while idle) finds no logs:
  # say so and end at once instead of polling nothing until SECONDS pass, on device time.
  if ! ls "$work"/*.log >/dev/null 2>&1; then
    echo "poll: no run logs under $work: this machine did not start the runs (a fresh machine?)" >&2
    exit 3
  fi
  # Copies what the runs have written so far into DEST, at every round: a device call cut at its time limit
  # (or a machine taken back) still brings the last round's files.
  collect() {
    [ -n "$dest" ] || return 0
    mkdir -p "$dest"
    for log in "$work"/*.log; do
      t=$(basename "$log" .log)
      # the target's log, each extraction's (its throughput and stages: the hybrid's takes 2-3x the Qwen3
      # target's) and every evaluation every run logged (so a call cut before the report still brings its
      # numbers back), in one file: a device call brings back 8 files at most
      {
        tail -n 60 "$log"
        for c in $(find "$work/$t" -name 'cache-*.log' 2>/dev/null | sort); do
          echo "== $(basename "$c")"
          tail -n 30 "$c"
        done
        echo "== evaluations"
        for m in $(find "$work/$t" -name metrics.jsonl 2>/dev/null | sort); do
          grep '"tau_walk"' "$m" | sed "s|^|$(basename "$(dirname "$m")") |"
        done
      } >"$dest/$t.log.tail"
      q=$(find "$work/$t" -name quality.json 2>/dev/null | head -n 1)
      if [ -n "$q" ]; then cp "$q" "$dest/$t-quality.json"; fi
    done
    # pack parts written by `--pack W/pack`: a target built across calls comes back with the call that sees
    # its build end (`pack` writes each part under a hidden name and renames it whole: `*` copies whole parts,
    # and a part already in DEST is this one, so `-n` copies each once a call)
    if [ -d "$work/pack" ]; then cp -n "$work"/pack/* "$dest"/ 2>/dev/null; fi
    return 0
  }
  declare -A shown=()
  while :; do
    pending=0
    for log in "$work"/*.log; do
      t=$(basename "$log" .log)
      if ! grep -q "^== exit" "$log" 2>/dev/null; then pending=$((pending + 1)); fi
      # a target's phase line when it changed since the last round (a device call's output keeps only its end)
      phase=$(grep -E '^\[' "$log" | tail -n 1)
      if [ "$phase" != "${shown[$t]:-}" ]; then echo "== $t: $phase"; shown[$t]=$phase; fi
      for m in $(find "$work/$t" -name metrics.jsonl 2>/dev/null | sort); do
        line=$(grep '"tau_walk"' "$m" | tail -n 1)
        last=$(tail -n 1 "$m")
        python3 - "$m" "$line" "$last" <<'EOF'
import json, sys
path, ev, last = sys.argv[1], sys.argv[2], sys.argv[3]
run = path.split("/")[-2]
step = json.loads(last).get("step") if last else None
e = json.loads(ev) if ev else {}
keys = ("step", "tau", "tau_walk", "tau_walk_lookup")
print(f"   {run}: step {step}; last eval " + ", ".join(f"{k} {round(e[k], 3)}" for k in keys if k in e))
EOF
      done
    done
    collect
    if [ "$pending" -eq 0 ] || [ "$SECONDS" -ge "$end" ]; then break; fi
    sleep "${POLL_EVERY:-30}"  # seconds between rounds (tests shorten it)
  done
  ;;
*)
  echo "usage: $0 start|poll ..." >&2
  exit 2
  ;;
esac
