# Sourced by the jobs in bench/jobs/.
# target_work W T: where bench_quality keeps target T's phases for `--work W` (bench/quality_pack.target_work):
# code in W itself, every other target in W/T.
target_work() {
  if [ "$2" = code ]; then echo "$1"; else echo "$1/$2"; fi
}
