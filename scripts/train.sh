#!/usr/bin/env bash
# Set up the environment if needed, then train: ./scripts/train.sh [hydra overrides...]
source "$(dirname "$0")/env.sh"
cd "$(dirname "$0")/.." && exec python -m launcher "$@"
