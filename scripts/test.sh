#!/usr/bin/env bash
# Set up the environment if needed, lint, type-check and check the import contracts, then run the whole suite:
#   ./scripts/test.sh [pytest args...]
source "$(dirname "$0")/env.sh"
cd "$(dirname "$0")/.." || exit 1
ruff check . && ruff format --check . && mypy && lint-imports || { echo "lint/type/import check failed (ruff check --fix . && ruff format . fixes most)" >&2; exit 1; }
# two workers (pytest-xdist): the modules using the host's test beds (netns, ssh machines, Slurm) run one after
# another on one of them, every other module whole on either (tests/conftest.py: BED_MODULES); LAUNCHER_TEST_WORKERS=0
# runs everything in this process
workers=${LAUNCHER_TEST_WORKERS:-2}
if [ "$workers" != 0 ]; then set -- -n "$workers" --dist loadgroup "$@"; fi
exec python -m pytest "$@"
