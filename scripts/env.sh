# Source me: creates .venv on first use (or when pyproject.toml changed) and activates it.
#   CPU box (no working nvidia-smi): installs torch==2.13.0 (CPU build) BEFORE the project, so pip never
#   resolves `torch>=2.8` to a multi-GB CUDA wheel.  GPU box: the project's `torch>=2.8` takes the CUDA build
#   (or keeps the torch you already have in the venv).  Override the pin with LAUNCHER_TORCH="torch==X.Y.Z".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAUNCHER_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.launcher-installed"
want="$(cat "$ROOT/pyproject.toml" | sha1sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "[setup] GPU found: torch comes from the project's requirement (CUDA build)" >&2
      [ -n "${LAUNCHER_TORCH:-}" ] && "$VENV/bin/pip" install -q "$LAUNCHER_TORCH"
    else
      echo "[setup] no GPU: installing ${LAUNCHER_TORCH:-torch==2.13.0} (CPU build) first" >&2
      "$VENV/bin/pip" install -q "${LAUNCHER_TORCH:-torch==2.13.0}"
    fi
  fi
  echo "[setup] installing launcher (editable) with test extras" >&2
  "$VENV/bin/pip" install -q -e "$ROOT[test]"
  echo "$want" > "$stamp"
fi
# The repo's own bytecode, written once (an editable install compiles none): where PYTHONDONTWRITEBYTECODE is set
# (CI's machines), each fresh interpreter -- every rank, agent and node process of a job -- compiled the launcher
# again, ~0.13 CPU-s each; later runs only compare times
"$VENV/bin/python" -m compileall -q -j 0 "$ROOT/launcher" "$ROOT/models" "$ROOT/tests" "$ROOT/bench" >/dev/null || true
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
set +euo pipefail
