"""Launchers: two "nodes" on one machine (two ``kvserve generate --nnodes 2`` processes
meeting at --master-addr/--master-port) and torchrun (``env://``); both must print the
TP=1 tokens. One thread per rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

# slow: spawns tensor-parallel rank processes
pytestmark = pytest.mark.slow

TIMEOUT_S = 240


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    return env


def _generate_cmd(path: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", "generate", "--model", path, "--prompt",
            "w1 w2 w3 w4 w5 w6 w7", "--max-tokens", "12", "--json", "--dtype", "float32",
            "--kv-cache-dtype", "fp32", "--kv-cache-memory", "4MiB", *extra]


def _tokens(stdout: str) -> list[int]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])["token_ids"]


@pytest.fixture(scope="module")
def reference(model_factory):
    path = model_factory("llama")
    out = subprocess.run(_generate_cmd(path), env=_env(), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    return path, _tokens(out.stdout)


def test_two_nodes_on_one_machine(reference):
    path, want = reference
    port = str(_port())
    common = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
              port, "--distributed-timeout", "60"]
    node1 = subprocess.Popen(_generate_cmd(path, *common, "--node-rank", "1"), env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        node0 = subprocess.run(_generate_cmd(path, *common, "--node-rank", "0"), env=_env(),
                               capture_output=True, text=True, timeout=TIMEOUT_S)
        _, err1 = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, err1
    assert _tokens(node0.stdout) == want


def test_torchrun_env_init(reference):
    path, want = reference
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(_port()), "-m", "kvserve.cli", *_generate_cmd(path, "-tp", "2",
                                                             "--distributed-init-method",
                                                             "env://")[3:]]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _tokens(out.stdout) == want


def test_gpu_check_dry_run_lists_the_tp_step():
    root = os.getcwd()
    env = dict(_env(), PYTHON=sys.executable)
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "scripts/gpu_check_tp.py compiles" in out.stdout
    assert "gpu_check_tp.py (tp=2 NCCL" in out.stdout
