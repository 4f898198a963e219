#!/usr/bin/env bash
# The default test suite (unit, Ray, and GPU tests that skip without CUDA). Slow tests: add `-m slow`.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_DEDUP_LOGS=0
# DeepSpeed compiles its C++ ops on first use (minutes): keep them in a cache that outlives the run.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/hamo_ray/torch_extensions}
python -m pytest "$@"
