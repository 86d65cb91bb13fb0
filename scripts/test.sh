#!/usr/bin/env bash
# Set up the environment if needed, lint, type-check, check the import contracts, build the docs, then run the tests:
#   ./scripts/test.sh [--durations] [--fast] [pytest args...]
# The suite is in four tiers (tests/README.md): rules/ (no process), ranks/ (real gloo ranks, no launcher), jobs/
# (python -m launcher on this machine), beds/ (network namespaces, the ssh machines, the local Slurm: root).
# --fast runs the first two (about 35 s here: run it before every commit); without it, the whole suite (CI's).
# --durations (no pytest args): a green run's figures go to tests/suite_figures.json and the README, where its time
# went to tests/durations/<lane>.txt (scripts/suite_figures.py)
start=$SECONDS
record=""
if [ "${1:-}" = "--durations" ]; then record=1; shift; fi
source "$(dirname "$0")/env.sh"
cd "$(dirname "$0")/.." || exit 1
ruff check . && ruff format --check . && mypy && lint-imports || { echo "lint/type/import check failed (ruff check --fix . && ruff format . fixes most)" >&2; exit 1; }
# the docs site (docs/, mkdocs.yml), warnings as errors: a broken link, a missing page or a stale snippet fails
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"; built=$?
rm -rf "$site"
[ "$built" = 0 ] || { echo "docs build failed (mkdocs build --strict): fix the page it names" >&2; exit 1; }
lane=full
if [ "${1:-}" = "--fast" ]; then lane=fast; shift; set -- tests/rules tests/ranks "$@"; fi
if [ -n "$record" ] && [ "$#" != "$([ "$lane" = fast ] && echo 2 || echo 0)" ]; then
  echo "--durations records a whole lane: no pytest arguments ($*)" >&2; exit 2
fi
# three workers (pytest-xdist; the beds' tests mostly wait on timeouts, daemons and heartbeats): the modules using one
# of the host's test beds (network namespaces, the ssh machines, the local Slurm) run one after another on one worker,
# every other module whole on any (tests/conftest.py: BED_OF_MODULE); LAUNCHER_TEST_WORKERS=0 runs everything in this
# process
workers=${LAUNCHER_TEST_WORKERS:-3}
if [ "$workers" != 0 ]; then set -- -n "$workers" --dist loadgroup "$@"; fi
if [ -z "$record" ]; then exec python -m pytest "$@"; fi
results="$(mktemp)"
began=$SECONDS
python -m pytest --junitxml="$results" "$@"; code=$?
pytest_s=$((SECONDS - began))
[ "$code" = 0 ] && python scripts/suite_figures.py --lane "$lane" --junit "$results" --pytest-s "$pytest_s" --whole-s $((SECONDS - start))
rm -f "$results"
exit "$code"
