#!/usr/bin/env bash
# q4 against a layer-delta q4 (a codec not built, simulated by bench/simulate_codec.py) for one seed of one target:
# its lossless, q4 and simulated runs side by side on the same batches, as one detached device job:
#
#   bash bench/device_job.sh start /tmp/q bench/jobs/layer_delta.sh code 2    # then: device_job.sh poll /tmp/q 560
#
# Reports: W/T-sS-q4.json (lossless and q4) and W/T-sS-q4delta.json (its q4 runs renamed q4delta: the cache they
# trained on holds the layer-delta decode), merged by `bench/quality_merge.py`. SIZE / DEVICE / RECIPE /
# DEVICE_ENV_NO_WHEELS / BUILD_ARGS as in seeds.sh (tests/test_device_job_sh.py runs it at the CI size on a CPU).
set -u
W=${1:?work folder}
T=${2:?target: code, prose or hybrid}
SEED=${3:?seed}
S="--size ${SIZE:-full} --device ${DEVICE:-cuda}"
source bench/device_env.sh
echo "== build $T $(date +%T)"
python3 bench/bench_quality.py --work "$W/$T" --target "$T" $S --codecs lossless,q4 --stop-after extract \
  ${BUILD_ARGS:-} >"$W/build.log" 2>&1 || exit
caches="$W/$T"; [ "$T" = code ] || caches="$W/$T/$T"   # bench/quality_pack.target_work
D="$W/delta"; sim="$D"; [ "$T" = code ] || sim="$D/$T"
echo "== simulate $(date +%T)"
mkdir -p "$sim"
for f in target data tokens cache-lossless; do [ -e "$caches/$f" ] && ln -sfn "$caches/$f" "$sim/$f"; done
python3 bench/simulate_codec.py "$caches/cache-lossless" "$sim/cache-q4" --codec q4 --layer-delta >"$W/simulate.log" 2>&1 ||
  exit
source bench/cuda_mps.sh /tmp/mps
B="python3 bench/bench_quality.py $S --recipe ${RECIPE:-defaults} --score-on lossless --fractions 1 --seeds 1
   --target $T --first-seed $SEED --runs-dir runs-s$SEED"
echo "== train $(date +%T)"
$B --work "$W/$T" --codecs lossless,q4 --parallel 2 --json "$W/$T-s$SEED-q4.json" >"$W/$T-s$SEED-q4.log" 2>&1 &
# its report under D (poll copies W's *.json): renamed into W below
$B --work "$D" --codecs q4 --json "$D/report.json" >"$W/$T-s$SEED-q4delta.log" 2>&1
wait
python3 - "$D/report.json" "$W/$T-s$SEED-q4delta.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for entry in report["runs"] + report.get("curves", []):
    entry["run"] = entry["run"].replace("-q4-", "-q4delta-")
report["simulated"] = "its q4delta runs trained on bench/simulate_codec.py --codec q4 --layer-delta of the lossless cache"
json.dump(report, open(sys.argv[2], "w"), indent=1)
PY
echo "== done $(date +%T)"
