#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv in .venv with kvserve and its dev extras.
# Idempotent: re-running only re-checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $PY" >&2
    "$PY" -m venv .venv
fi
stamp=.venv/.kvserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    # torch first, from the pinned CPU wheel; the constraint keeps it there for everything else.
    .venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev,triton]"
    touch "$stamp"
fi
.venv/bin/python -c "import torch, kvserve; print('[setup] ok: torch', torch.__version__)" >&2
