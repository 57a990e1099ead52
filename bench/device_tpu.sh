#!/usr/bin/env bash
# One TPU v5e run in one device call (< 9 min wall): Pallas kernels vs their jnp references on the chip, 26B-A4B and
# E2B decode / prefill throughput with the engine's step, how much HBM a real 26B program can use, kernel speed.
# Uses the machine's own python3 (JAX + jaxlib + libtpu + numpy + scipy; nothing else is needed or installed) and
# the gemmajax package of this checkout (on PYTHONPATH). One python process opens the TPU (nothing here touches it
# before). Prints results as they come and a summary; with $OUT set (the device tool) the whole log is also written
# to $OUT/device_tpu.log. Extra arguments go to bench/device_tpu.py (e.g. --skip speed, --kv-gib-26b 1.2, --tiny).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
unset JAX_PLATFORMS  # the Makefile exports JAX_PLATFORMS=cpu for the tests: the TPU must be visible here
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp}/device_tpu.log
mkdir -p "$(dirname "$LOG")"
{
  echo "== $(date -u +%FT%TZ) $(hostname) $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo 2>/dev/null)"
  if rev=$(git rev-parse --short HEAD 2>/dev/null); then
    echo "== git $rev$(git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
  fi
  "$PY" - <<'PYEOF' 2>&1  # versions from package metadata: nothing here imports jax or opens the TPU
import sys
from importlib.metadata import PackageNotFoundError, version

def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"

print("== python", sys.version.split()[0], *(f"| {p} {v(p)}" for p in ("jax", "jaxlib", "libtpu", "numpy")))
PYEOF
} | tee "$LOG"
# The script's deadline (500 s of work after its imports) and watchdog (+20 s) end it first; timeout is a last resort.
timeout --kill-after=10 550 "$PY" bench/device_tpu.py "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "== exit status $rc" | tee -a "$LOG"
exit "$rc"
