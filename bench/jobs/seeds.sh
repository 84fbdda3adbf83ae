#!/usr/bin/env bash
# One quality-benchmark target's seeds on lossless / fp8 / q4 (and, with `distill`, each seed's distilled lossless
# run), every run side by side under MPS, as one detached device job (issue 29's codec and distillation criteria):
#
#   bash bench/device_job.sh start /tmp/q bench/jobs/seeds.sh code "2" distill   # then, each call at once:
#   bash bench/device_job.sh poll /tmp/q 560                                        # carry .whl
#
# Builds the target (or reuses a built one under W), then starts the first seed's bench process, which extracts
# the three caches; the other processes start once those are complete and reuse them (never extract beside it).
# Reports: W/T-sS.json (codecs) and W/T-sS-distill.json, merged by `bench/quality_merge.py --across-rows` with
# other sessions' (a target rebuilt on another machine has the same weights, other rows). On one H100, code's
# seed 2 with its distilled run (four runs) took 4 min of build, 1.5 of extraction and 11 of training; on one
# H200, prose's seed 0 with its distilled run 5 of build (BUILD_ARGS="--gen-batch 4160"), 3.7 of extraction and
# 11 of training (6 epochs, the defaults then; since 2026-12-07 the defaults train these 16k-row datasets for 10:
# three runs side by side ~13 min on one H100, bench/jobs/epochs.sh's). UNPACK=DIR / PACK=1
# (bench/jobs/lib.sh's build_target): start from a pack an earlier job brought back (carry it) instead of
# building; pack this build for a later session.
# CODECS=lossless,q4 trains fewer codecs per seed (default lossless,fp8,q4; side by side, one run each).
# ROWS_CHECK=N also runs `bench_target_determinism.py --rows N` beside the build (W/rows-determinism.txt).
# BUILD_ARGS adds flags to the build: the hybrid's `--gen-batch 4160 --compile-target reduce-overhead` (its rows in
# about a minute, BENCHMARKS.md's hybrid sections).
# SIZE=ci DEVICE=cpu RECIPE=size DEVICE_ENV_NO_WHEELS=1 runs the same steps on a CPU box in a minute (a check of
# the job, not a measurement: the CI size cannot take dflash-train's defaults; tests/test_device_job_sh.py).
set -u
W=${1:?work folder}
T=${2:?target: code, prose or hybrid}
SEEDS=${3:?seeds, e.g. "0 1"}
DISTILL=${4:-}
CODECS=${CODECS:-lossless,fp8,q4}
S="--size ${SIZE:-full} --device ${DEVICE:-cuda}"
source bench/device_env.sh
source bench/jobs/lib.sh
RUNS=$(codec_count "$CODECS")
if [ -n "${ROWS_CHECK:-}" ]; then
  # beside the build (~1 min): the target's shape trained once and N greedy rows generated twice from it; do two
  # generations in one process agree (so the rows' differing between machines is the machine, not a kernel)?
  python3 bench/bench_target_determinism.py $S --target "$T" --steps 300 --builds 1 --rows "$ROWS_CHECK" \
    >"$W/rows-determinism.txt" 2>&1 &
fi
echo "== build $T $(date +%T)"
build_target "$W" "$T" data $S ${BUILD_ARGS:-} || exit
source bench/cuda_mps.sh /tmp/mps
B="python3 bench/bench_quality.py $S --recipe ${RECIPE:-defaults} --score-on lossless --fractions 1 --seeds 1
   --curves all --work $W/$T --target $T"
first=1
for seed in $SEEDS; do
  echo "== $T seed $seed, $CODECS $(date +%T)"
  $B --codecs "$CODECS" --parallel "$RUNS" --first-seed "$seed" --runs-dir "runs-s$seed" --json "$W/$T-s$seed.json" \
    >"$W/$T-s$seed.log" 2>&1 &
  if [ "$first" = 1 ]; then
    caches=$(target_work "$W/$T" "$T")
    for c in ${CODECS//,/ }; do bash bench/jobs/await_cache.sh "$caches/cache-$c" $! || exit; done
    first=0
  fi
  if [ "$DISTILL" = distill ]; then
    echo "== $T seed $seed, distilled $(date +%T)"
    $B --codecs lossless --variants "distill=--distill 0.5" --first-seed "$seed" --runs-dir "runs-distill-s$seed" \
      --json "$W/$T-s$seed-distill.json" >"$W/$T-s$seed-distill.log" 2>&1 &
  fi
done
wait
echo "== done $(date +%T)"
