#!/usr/bin/env bash
# One target built and packed, nothing else, as one detached device job: a session with device time left but
# not enough for a whole job spends it on a later session's build (~4-7 minutes there):
#
#   bash bench/device_job.sh start /tmp/q bench/jobs/pack.sh code     # then: device_job.sh poll /tmp/q 560
#
# Poll brings the parts back into DEST/pack; keep them in an ignored folder and start the later job with
# UNPACK=that-folder. SIZE / DEVICE / DEVICE_ENV_NO_WHEELS / BUILD_ARGS as in seeds.sh.
set -u
W=${1:?work folder}
T=${2:?target: code, prose or hybrid}
source bench/device_env.sh
source bench/jobs/lib.sh
echo "== build $T $(date +%T)"
PACK=1 build_target "$W" "$T" data --size "${SIZE:-full}" --device "${DEVICE:-cuda}" ${BUILD_ARGS:-} || exit
wait
[ -d "$W/pack" ] || { echo "pack failed: $W/pack.log" >&2; exit 1; }
echo "== packed $(date +%T)"
