#!/usr/bin/env bash
# The Python packages a GPU machine with its own torch may lack (Hydra, OmegaConf, submitit and their needs), as
# wheels in .whl/ (ignored by git), for a machine that cannot reach PyPI. There, from the repo root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
#   python3 -m pytest -m gpu tests/jobs/test_gpu.py        # the GPU tests (docs/gpus.md, "GPU tests")
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    "${platforms[@]}" -d .whl hydra-core==1.3.2 omegaconf==2.3.0 submitit==1.5.2 pytest-timeout==2.4.0 setproctitle==1.3.8 torchmetrics==1.9.0 lightning-utilities==0.15.2
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3   # published as a source archive only
ls .whl
