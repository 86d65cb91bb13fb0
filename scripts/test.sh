#!/usr/bin/env bash
# Set up the environment if needed, lint, type-check and check the import contracts, then run the whole suite:
#   ./scripts/test.sh [pytest args...]
source "$(dirname "$0")/env.sh"
cd "$(dirname "$0")/.." || exit 1
ruff check . && ruff format --check . && mypy && lint-imports || { echo "lint/type/import check failed (ruff check --fix . && ruff format . fixes most)" >&2; exit 1; }
exec python -m pytest "$@"
