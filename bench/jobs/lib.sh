# Sourced by the jobs in bench/jobs/.
# target_work W T: where bench_quality keeps target T's phases for `--work W` (bench/quality_pack.target_work):
# code in W itself, every other target in W/T.
target_work() {
  if [ "$2" = code ]; then echo "$1"; else echo "$1/$2"; fi
}

# codec_count LIST: how many codecs a comma-separated CODECS names (one training run each, side by side).
codec_count() {
  echo "$1" | tr , '\n' | wc -l
}

# build_target W T STOP [FLAGS...]: bench_quality's phases of target T under W/T up to STOP (data or extract),
# log W/build.log. UNPACK=DIR starts from the tar parts a job packed earlier (the target and rows not built again:
# ~5 minutes of a device session); PACK=1 then packs target/ and data/ into W/pack, beside what the job does next,
# for device_job.sh poll to bring back (folder renamed from W/pack.part once every part is written).
build_target() {
  local w=$1 t=$2 stop=$3
  shift 3
  python3 bench/bench_quality.py --work "$w/$t" --target "$t" --stop-after "$stop" ${UNPACK:+--unpack "$UNPACK"} \
    "$@" >"$w/build.log" 2>&1 || return
  if [ -n "${PACK:-}" ]; then
    rm -rf "$w/pack.part" "$w/pack"
    (python3 bench/bench_quality.py --work "$w/$t" --target "$t" --stop-after data --pack "$w/pack.part" "$@" \
      >"$w/pack.log" 2>&1 && mv "$w/pack.part" "$w/pack") &
  fi
}
