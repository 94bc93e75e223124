#!/usr/bin/env bash
# Creates (or reuses) .venv-verifiers, the virtualenv of verifiers that
# examples/verifiers_calculator.py runs in: verifiers at the pin of pyproject.toml's
# `verifiers` extra, alone (about 590 MB, no torch). It cannot share .venv: verifiers
# 0.4.0 pins openai<3 and mcp==2.0.0, below what vLLM uses (docs/agents.md, verifiers).
# Idempotent: exits at once when the virtualenv already has that version.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VERIFIERS_VENV:-.venv-verifiers}
PIN=$("$PYTHON" -c 'import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(*extras["verifiers"])')
VERSION=${PIN#verifiers==}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "
import importlib.metadata, sys
sys.exit(importlib.metadata.version('verifiers') != '$VERSION')" 2>/dev/null; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
echo "installing $PIN into $VENV (about 590 MB, a few minutes) ..."
# No .pyc compiled at install (half its time), then only the modules the episode server
# imports (examples/verifiers_calculator.py): written here even where the caller's
# environment turns bytecode writing off, so no server start compiles them again.
"$VENV/bin/pip" install -q --no-compile --disable-pip-version-check "$PIN"
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c "import httpx, openai, verifiers.v1
import verifiers.v1.dialects.chat, verifiers.v1.runtimes, verifiers.v1.utils.memory"
