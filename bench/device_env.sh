# Source this on a GPU machine with no network and no install of dflash:
#   source bench/device_env.sh
# It installs carried wheels (.whl/: zstandard, FLA; .whl-s3/: moto and s3fs, see bench/device_wheels.txt)
# into /tmp/site and exposes the repo's phase folders
# as the `dflash` package through symlinks, so `python bench/...` runs without `pip install`.
set -e
# DEVICE_ENV_NO_WHEELS=1 skips them: a CPU box's check of a device job (its python is not the device's 3.12)
wheels=$([ -n "${DEVICE_ENV_NO_WHEELS:-}" ] || ls .whl/*.whl .whl-s3/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
fi
mkdir -p /tmp/ns/dflash
for part in shards extract train tools; do ln -sfn "$PWD/$part" "/tmp/ns/dflash/$part"; done
export PYTHONPATH="/tmp/ns:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
set +e
