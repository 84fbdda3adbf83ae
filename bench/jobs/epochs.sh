#!/usr/bin/env bash
# A longer schedule on one target's lossless cache, its seeds side by side under MPS, as one detached device job
# (issue 29: the hybrid's walk still rises at the defaults' last step; does it want 10 epochs instead of 6?):
#
#   UNPACK=.qh bash bench/device_job.sh start /tmp/q bench/jobs/epochs.sh hybrid 10 2 3   # carry .whl and .qh
#   bash bench/device_job.sh poll /tmp/q 560                                             # then each call at once
#
# Arguments: target, epochs N, first seed, number of seeds. Trains dflash-train's defaults with `--epochs N`
# (variant eN) on each seed, in one bench_quality process that extracts the lossless cache once. Report:
# W/T-eN.json, which pairs by seed with the defaults' runs of the same instance (seeds.sh's reports, from the
# same pack): `bench/quality_merge.py` lists eN against base. UNPACK / PACK / BUILD_ARGS / SIZE as in seeds.sh.
# CODECS=lossless,q4 trains each seed on those caches too (default lossless alone), every run side by side: the
# codec gaps of the longer schedule, paired within it (bench_quality's vs-lossless column).
set -u
W=${1:?work folder}
T=${2:?target: code, prose or hybrid}
EPOCHS=${3:?epochs}
FIRST=${4:?first seed}
COUNT=${5:?number of seeds}
CODECS=${CODECS:-lossless}
S="--size ${SIZE:-full} --device ${DEVICE:-cuda}"
source bench/device_env.sh
source bench/jobs/lib.sh
RUNS=$(($(codec_count "$CODECS") * COUNT))
echo "== build $T $(date +%T)"
build_target "$W" "$T" data $S ${BUILD_ARGS:-} || exit
source bench/cuda_mps.sh /tmp/mps
echo "== $T, $EPOCHS epochs, seeds $FIRST.. ($COUNT), $CODECS $(date +%T)"
python3 bench/bench_quality.py $S --recipe "${RECIPE:-defaults}" --score-on lossless --fractions 1 --curves all \
  --work "$W/$T" --target "$T" --codecs "$CODECS" --variants "e$EPOCHS=--epochs $EPOCHS" \
  --first-seed "$FIRST" --seeds "$COUNT" --parallel "$RUNS" --runs-dir "runs-e$EPOCHS" \
  --json "$W/$T-e$EPOCHS.json" >"$W/$T-e$EPOCHS.log" 2>&1 || exit
echo "== done $(date +%T)"
