#!/usr/bin/env bash
# The trainer-side GPU check (bench/gpu_check.py): one table, under 8 minutes on one GPU;
# one line and exit 0 where there is no CUDA. Needs only Python with torch and
# transformers: the wheels it also needs (msgspec, nvidia-ml-py) come from
# scripts/wheels, installed with no index into runs/gpu-check-libs when the Python lacks
# them. PYTHON picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIBS=runs/gpu-check-libs
export PYTHONPATH="$PWD:$PWD/$LIBS${PYTHONPATH:+:$PYTHONPATH}"
for pair in msgspec:msgspec pynvml:nvidia-ml-py; do
    if ! "$PY" -c "import ${pair%%:*}" 2>/dev/null; then
        "$PY" -m pip install --quiet --no-index --find-links scripts/wheels --target "$LIBS" \
            "${pair#*:}"
    fi
done
exec "$PY" bench/gpu_check.py "$@"
