# Source this on a GPU machine before starting runs side by side, so their kernels can share the GPU at once:
#   source bench/cuda_mps.sh DIR          # then: bash bench/quality_targets.sh start ...
# Without it, the GPU time-slices between processes: three or four training runs side by side shared ~23-25
# steps/s in all, where one alone ran 18-21 (BENCHMARKS.md, 2026-12-05), whatever the loader's worker count.
# CUDA MPS (Multi-Process Service) runs every client's kernels through one server, concurrently. This starts its
# control daemon as this user with its pipes and logs under DIR and changes no device setting (no compute mode,
# nothing `nvidia-smi` sets); the daemon ends with the machine, or with `echo quit | nvidia-cuda-mps-control`
# under the same CUDA_MPS_PIPE_DIRECTORY.
# It then checks that a CUDA client starts through the daemon ($MPS_CHECK, default: a tensor on the GPU from
# python3 with torch, 120 s at most). If MPS is missing or the check fails, it stops what it started, unsets
# CUDA_MPS_* so the runs go on without it, and says so in one line: a run never waits on a broken MPS.
# Each case prints one line starting "cuda_mps:"; CUDA_MPS_ON is 1 or 0 afterwards.
_mps_dir=${1:?usage: source bench/cuda_mps.sh DIR}
CUDA_MPS_ON=0
_mps_off() {
  echo "cuda_mps: off ($1); runs time-slice the GPU"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  _mps_off "no nvidia-cuda-mps-control on PATH"
else
  mkdir -p "$_mps_dir/pipe" "$_mps_dir/log"
  export CUDA_MPS_PIPE_DIRECTORY="$_mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$_mps_dir/log"
  if ! nvidia-cuda-mps-control -d >"$_mps_dir/start.out" 2>&1; then
    _mps_off "the daemon did not start: $(head -c 200 "$_mps_dir/start.out" | tr -s '\n' ' ' | sed 's/ $//')"
  elif ! timeout 120 bash -c "${MPS_CHECK:-python3 -c 'import torch; torch.zeros(1, device=\"cuda\").sum().item()'}" \
    >"$_mps_dir/check.out" 2>&1; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    _mps_off "a CUDA client failed through it: $(tail -n 1 "$_mps_dir/check.out" | head -c 200)"
  else
    CUDA_MPS_ON=1
    echo "cuda_mps: on (pipes in $CUDA_MPS_PIPE_DIRECTORY; processes started from this shell share the GPU)"
  fi
fi
unset -f _mps_off
unset _mps_dir
export CUDA_MPS_ON
