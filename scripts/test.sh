#!/usr/bin/env bash
# Run the whole test suite (sets up .venv first if needed). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
