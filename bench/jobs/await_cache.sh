#!/usr/bin/env bash
# Waits until the cache at $1 is complete (its manifest says so: written last by dflash-extract), so that a second
# bench_quality process in the same work folder reuses it instead of extracting it beside the first.
until python3 -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('complete'))" "$1/manifest.json" \
  2>/dev/null; do
  sleep 5
done
