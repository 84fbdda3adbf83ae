# Source this on a GPU machine with no network and no install of dflash:
#   source bench/device_env.sh
# It installs carried wheels (.whl/, see BENCHMARKS.md) into /tmp/site and exposes the repo's phase folders
# as the `dflash` package through symlinks, so `python bench/...` runs without `pip install`.
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/ns/dflash
for part in shards extract train tools; do ln -sfn "$PWD/$part" "/tmp/ns/dflash/$part"; done
export PYTHONPATH="/tmp/ns:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
set +e
