#!/usr/bin/env bash
# E2B-shaped decode (bf16, w8a8) at 1/16/64 streams and its kernels on a lent H200, in one device call (< 10 min).
# Uses the device image's own python3 (JAX with the CUDA plugin is installed there; nothing can be pip-installed),
# and the gemmajax package of this checkout (on PYTHONPATH). Prints a table; with $OUT set (the device tool), the
# log is also written to $OUT/device_h200.log. Extra arguments go to bench/device_h200.py (e.g. --context 4096).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
LOG=${OUT:-/tmp}/device_h200.log
{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1
} | tee "$LOG"
if ! "$PY" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" 2>/dev/null; then
  echo "no GPU backend in $PY's JAX: see /work/.library/device/KINDS.md for what the image holds" | tee -a "$LOG"
  exit 2
fi
timeout 570 "$PY" bench/device_h200.py --deadline 480 "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
