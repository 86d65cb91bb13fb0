#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite: ./scripts/test.sh [pytest args...]
source "$(dirname "$0")/env.sh"
cd "$(dirname "$0")/.." && exec python -m pytest "$@"
