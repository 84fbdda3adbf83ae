#!/usr/bin/env bash
# Waits until the cache at $1 is complete (its manifest says so: written last by dflash-extract), so that a second
# bench_quality process in the same work folder reuses it instead of extracting it beside the first. With $2, the
# PID of the process extracting it: fails (status 1) once that process has ended and the cache is not complete,
# instead of waiting for the rest of the device session.
cache=${1:?cache folder}
pid=${2:-}
until python3 -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('complete'))" "$cache/manifest.json" \
  2>/dev/null; do
  if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
    echo "await_cache: $cache is not complete and the process making it ($pid) has ended" >&2
    exit 1
  fi
  sleep "${AWAIT_EVERY:-5}"
done
