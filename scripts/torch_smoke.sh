#!/usr/bin/env bash
# The smoke checks of a torch version, in a throw-away environment (removed at the end, pass or fail):
#   scripts/torch_smoke.sh 2.8.0          # torch==2.8.0 from the package index (a CPU box: the CUDA build runs on CPU)
#   LAUNCHER_SMOKE_KEEP=1 scripts/torch_smoke.sh 2.8.0   # keep the environment (printed) to look into a failure
# 1. the README's first command (the default job on 2 gloo ranks), 2. a 2-rank torchrun-style script (script=),
# 3. a hang named by the progress watch (the culprit first). pyproject's torch floor is the oldest version that
# passed; the README ("Supported torch versions", in its first-run section) lists what was run and when.
set -euo pipefail
VERSION=${1:?usage: scripts/torch_smoke.sh TORCH_VERSION}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/launcher-torch-$VERSION.XXXXXX")
[[ -n ${LAUNCHER_SMOKE_KEEP:-} ]] || trap 'rm -rf "$WORK"' EXIT
cd "$ROOT"
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
echo "[smoke] torch==$VERSION into $WORK/venv" >&2
"$PY" -m pip install -q "torch==$VERSION"
"$PY" -m pip install -q "$ROOT"  # the launcher's other requirements; runs below import this checkout (cwd)
export PYTHONDONTWRITEBYTECODE=1
fail() { echo "[smoke] torch $VERSION: FAILED: $1 (output in $WORK/$2.log)" >&2; LAUNCHER_SMOKE_KEEP=1; trap - EXIT; exit 1; }

"$PY" -m launcher train.max_steps=30 "hydra.run.dir=$WORK/default" > "$WORK/default.log" 2>&1 \
  || fail "the default job" default
echo "[smoke] 1/3 the default job on 2 gloo ranks: ok" >&2

mkdir -p "$WORK/script-out"
"$PY" -m launcher script=tests/scripts/env_script.py "script_args=[$WORK/script-out]" "hydra.run.dir=$WORK/script" \
  > "$WORK/script.log" 2>&1 || fail "a 2-rank script= job" script
grep -q '"allreduce": 3.0' "$WORK/script-out/rank-1.json" || fail "the script's allreduce" script
echo "[smoke] 2/3 a 2-rank script= job: ok" >&2

HANG_CASE=stuck "$PY" -m launcher script=tests/scripts/hang_script.py comm.hang_warn_s=3 comm.timeout_s=10 \
  "hydra.run.dir=$WORK/hang" > "$WORK/hang.log" 2>&1 && fail "the hung job did not fail" hang
grep -q "hang: rank 1 " "$WORK/hang.log" || fail "no hang named (rank 1 first)" hang
echo "[smoke] 3/3 a hang named: ok" >&2
echo "[smoke] torch $VERSION: passed ($("$PY" -c 'import torch; print(torch.__version__)'))"
