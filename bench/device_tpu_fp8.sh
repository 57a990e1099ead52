#!/usr/bin/env bash
# fp8 KV against bf16 KV on a real TPU v5e, in one device call (bench/device_tpu_fp8.py; < 9 min). Uses the
# machine's python3 and this checkout's gemmajax; with $OUT set the log is also written to $OUT/device_tpu_fp8.log.
# Arguments go to the script (e.g. --only attn,e2b or --only 26b).
set -uo pipefail
cd "$(dirname "$0")/.."
unset JAX_PLATFORMS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp}/device_tpu_fp8.log
echo "== $(date -u +%FT%TZ) git $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')" | tee "$LOG"
timeout --kill-after=10 550 "${PYTHON:-python3}" bench/device_tpu_fp8.py "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "== exit status $rc" | tee -a "$LOG"
exit "$rc"
