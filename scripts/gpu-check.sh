#!/usr/bin/env bash
# The trainer-side GPU check (bench/trainer/gpu_check.py): one table, a row printed as each is
# made and appended to runs/gpu-check/results.md (--out DIR picks the folder), under 8
# minutes on one GPU; one line and exit 0 where there is no CUDA. Needs only Python with
# torch and transformers: the other modules its imports need (msgspec, nvidia-ml-py,
# psutil) come from the wheels in scripts/wheels, installed with no index into
# runs/gpu-check-libs when the Python lacks them. PYTHON picks the interpreter (default:
# python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIBS=runs/gpu-check-libs
# module:distribution, one pair per carried wheel (tests/unit/test_gpu_check.py reads it)
WHEELS="msgspec:msgspec pynvml:nvidia-ml-py psutil:psutil"
export PYTHONPATH="$PWD:$PWD/$LIBS${PYTHONPATH:+:$PYTHONPATH}"
for pair in $WHEELS; do
    if ! "$PY" -c "import ${pair%%:*}" 2>/dev/null; then
        "$PY" -m pip install --quiet --no-index --find-links scripts/wheels --target "$LIBS" \
            "${pair#*:}"
    fi
done
exec "$PY" -m bench.trainer.gpu_check "$@"
