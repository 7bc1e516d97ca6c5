#!/usr/bin/env bash
# Schemathesis CLI (`st run --checks all`) against the router of `kvserve serve -dp 2 --model
# demo` and against one replica (`kvserve serve --model demo`), on loopback; the servers are
# started here and stopped on exit. Extra arguments go to `st run` after the defaults below
# (e.g. `--max-examples 200`, `--phases fuzzing`, `--report junit`); exit status: non-zero when
# st found anything on either server. tests/server/test_schemathesis_cli.py is the bounded CI
# version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ST="$(dirname "$PY")/st"
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" SCHEMATHESIS_TELEMETRY=false \
    SCHEMATHESIS_HOOKS="$PWD/scripts/schemathesis_hooks.py"
SERVE=(serve --model demo --max-model-len 64 --kv-cache-memory 16MiB --max-n 4)
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
pids=()
logs=$(mktemp -d)
stop() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    echo "server logs (and st's reports): $logs"
}
trap stop EXIT
start() {  # start NAME PORT ARGS...: a server in the background, logged to $logs/NAME.log
    local name=$1 port=$2; shift 2
    "$PY" -m kvserve.cli "${SERVE[@]}" --port "$port" "$@" >"$logs/$name.log" 2>&1 &
    pids+=($!)
}
wait_ready() {  # wait_ready PORT REPLICAS: until /ready says 200 (and that many replicas)
    for _ in $(seq 600); do
        if "$PY" - "$1" "$2" <<'EOF'
import sys, httpx
try:
    r = httpx.get(f"http://127.0.0.1:{sys.argv[1]}/ready", timeout=2)
    sys.exit(r.status_code != 200 or r.json().get("replicas", 0) < int(sys.argv[2]))
except (httpx.HTTPError, ValueError):
    sys.exit(1)
EOF
        then return 0; fi
        sleep 0.5
    done
    echo "server on port $1 never became ready" >&2
    return 1
}
replica_port=$(free_port)
router_port=$(free_port)
start replica "$replica_port"
start router "$router_port" -dp 2 --replica-threads 1 --health-interval 0.2
wait_ready "$replica_port" 0
wait_ready "$router_port" 2
rc=0
for target in "replica:$replica_port" "router:$router_port"; do
    echo "== st run --checks all: ${target%%:*}"
    # every check; positive_data_acceptance as scripts/schemathesis_hooks.py runs it
    # in $logs: st's state (.schemathesis/) and any --report land there
    (cd "$logs" && "$ST" run "http://127.0.0.1:${target##*:}/openapi.json" --checks all \
        --exclude-checks positive_data_acceptance --seed 41 --workers 1 --request-timeout 60 \
        --generation-database none --output-sanitize false "$@") || rc=1
done
exit $rc
