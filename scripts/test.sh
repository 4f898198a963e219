#!/usr/bin/env bash
# The default test suite (unit, Ray, and GPU tests that skip without CUDA). Slow tests: add `-m slow`.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_DEDUP_LOGS=0
export HAMO_CACHE_DIR=${HAMO_CACHE_DIR:-$HOME/.cache/hamo_ray}
python -m pytest "$@"
