#!/usr/bin/env bash
# A device session's GPU work as one detached job that its calls only follow, so that no run is cut at a call's
# time limit and no GPU time is lost between steps (what a step needs comes from the one before, on the machine):
#
#   bash bench/device_job.sh start W JOB.sh [ARGS...]  # `bash JOB.sh W ARGS...` under setsid; output: W/job.log
#   bash bench/device_job.sh poll W SECONDS            # follows it; each round copies what it wrote into $OUT
#
# The job marks its steps with lines starting "== " (echo "== build $(date +%T)"); `start` ends its log with
# "== exit CODE". `poll` prints, every POLL_EVERY seconds (60), the log's last step line when it changed and each
# training run's last logged step under W (metrics.jsonl), until the job has ended or SECONDS pass, and copies
# into $OUT (or DEST, poll's fourth argument): job.log, W's *.json and *.txt (reports, tables), one file of
# every other W/*.log's last 40 lines (logs.tail) and every run's evaluations so far with its pairs' gaps at the
# same steps (curves.txt, bench/quality_curves.py: what a job cut at the session's end still measured), and the
# tar parts of a job's W/pack (PACK=1 in bench/jobs/lib.sh) into DEST/pack. A device call brings back 8 files:
# keep the job's *.json and *.txt to five, three with a pack (two parts). Each call must be sent at once after
# the last (a warm machine waits 30 s); one that lands on a fresh machine finds no job and ends at once with
# status 3. bench/jobs/ holds jobs.
set -u
cmd=${1:?start or poll}
work=${2:?work folder}
case "$cmd" in
start)
  job=${3:?job script}
  shift 3
  mkdir -p "$work"
  setsid nohup bash -c 'bash "$@"; echo "== exit $?"' _ "$job" "$work" "$@" >"$work/job.log" 2>&1 </dev/null &
  echo "started $job (log $work/job.log)"
  ;;
poll)
  seconds=${3:?seconds}
  dest=${4:-${OUT:-}}
  if [ ! -f "$work/job.log" ]; then
    echo "poll: no job.log under $work: this machine did not start the job (a fresh machine?)" >&2
    exit 3
  fi
  end=$((SECONDS + seconds))
  shown=""
  while :; do
    # read before copying: the round that sees the job's end copies and prints all it wrote
    ended=0
    if grep -q '^== exit' "$work/job.log" || [ "$SECONDS" -ge "$end" ]; then ended=1; fi
    if [ -n "$dest" ]; then
      mkdir -p "$dest"
      cp "$work/job.log" "$dest/"
      for f in "$work"/*.json "$work"/*.txt; do [ -f "$f" ] && cp "$f" "$dest/"; done
      if [ -d "$work/pack" ]; then mkdir -p "$dest/pack" && cp "$work/pack"/* "$dest/pack/"; fi
      for f in "$work"/*.log; do
        [ "$f" = "$work/job.log" ] || { echo "== $(basename "$f")"; tail -n 40 "$f"; }
      done >"$dest/logs.tail"
      # every run's evaluations so far and its pairs' gaps (dflash as device_env.sh exposed it to the job)
      PYTHONPATH="/tmp/ns${PYTHONPATH:+:$PYTHONPATH}" python3 "$(dirname "$0")/quality_curves.py" "$work" \
        >"$dest/curves.txt" 2>&1
    fi
    step=$(grep '^== ' "$work/job.log" | tail -n 1)
    if [ "$step" != "$shown" ]; then echo "$(date +%T) $step"; shown=$step; fi
    find "$work" -name metrics.jsonl 2>/dev/null | sort | while read -r m; do
      echo "   $(basename "$(dirname "$m")"): $(tail -n 1 "$m" | grep -o '"step": [0-9]*')"
    done
    if [ "$ended" -eq 1 ]; then break; fi
    sleep "${POLL_EVERY:-60}"
  done
  ;;
*)
  echo "usage: $0 start W JOB.sh [ARGS...] | poll W SECONDS [DEST]" >&2
  exit 2
  ;;
esac
