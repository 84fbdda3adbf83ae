#!/usr/bin/env bash
# q4 against a layer-delta q4 (a codec not built, simulated by bench/simulate_codec.py) for one seed of one target:
# its lossless, q4 and simulated runs side by side on the same batches, as one detached device job:
#
#   bash bench/device_job.sh start /tmp/q bench/jobs/layer_delta.sh code 2    # then: device_job.sh poll /tmp/q 560
#
# The simulated cache is W's cache-q4delta, so bench_quality trains and reports it under that name (one report,
# W/T-sS-q4delta.json, every run paired with the seed's lossless run). SIZE / DEVICE / RECIPE /
# DEVICE_ENV_NO_WHEELS / BUILD_ARGS as in seeds.sh (tests/test_device_job_sh.py runs it at the CI size on a CPU).
set -u
W=${1:?work folder}
T=${2:?target: code, prose or hybrid}
SEED=${3:?seed}
S="--size ${SIZE:-full} --device ${DEVICE:-cuda}"
source bench/device_env.sh
source bench/jobs/lib.sh
echo "== build $T $(date +%T)"
build_target "$W" "$T" extract $S --codecs lossless,q4 ${BUILD_ARGS:-} || exit
caches=$(target_work "$W/$T" "$T")
echo "== simulate $(date +%T)"
# on the GPU, idle between extraction and training: on the device's CPUs the full size's 5.3M tokens would take
# minutes (~11 on two cores; BENCHMARKS.md, "The hybrid's seed 2 on spans")
python3 bench/simulate_codec.py "$caches/cache-lossless" "$caches/cache-q4delta" --codec q4 --layer-delta \
  --device "${DEVICE:-cuda}" >"$W/simulate.log" 2>&1 || exit
source bench/cuda_mps.sh /tmp/mps
echo "== train $(date +%T)"
python3 bench/bench_quality.py $S --recipe "${RECIPE:-defaults}" --score-on lossless --fractions 1 --seeds 1 \
  --curves all --work "$W/$T" --target "$T" --codecs lossless,q4,q4delta --parallel 3 --first-seed "$SEED" \
  --runs-dir "runs-s$SEED" --json "$W/$T-s$SEED-q4delta.json" >"$W/$T-s$SEED-q4delta.log" 2>&1
wait
echo "== done $(date +%T)"
