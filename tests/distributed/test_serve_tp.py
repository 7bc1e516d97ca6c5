"""``kvserve serve -tp 2``: answers OpenAI-client requests like the single-process engine,
SIGTERM stops every rank, and a worker that dies or hangs fails the request in flight, turns
/health unhealthy and makes the server exit 1 naming the rank (no silent hang)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

# slow: spawns tensor-parallel servers
pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _worker_pid(server: ServerProcess) -> int:
    kids = [p for p in _children(server.proc.pid) if _alive(p)]
    for pid in kids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():  # not the resource tracker
                return pid
    raise AssertionError(f"no worker process among {kids}")


@pytest.fixture(scope="module")
def tp_server(tiny_llama):
    server = ServerProcess(tiny_llama, "-tp", "2", "--distributed-timeout", "30")
    try:
        yield server.wait_healthy(timeout=180)
    finally:
        server.stop()


def test_openai_client_against_tp2(tp_server, tiny_llama, make_llm):
    from openai import OpenAI

    oai = OpenAI(base_url=f"{tp_server.url}/v1", api_key="x")
    got = oai.completions.create(model="tiny", prompt="w1 w2 w3 w4", max_tokens=12,
                                 temperature=0)
    from kvserve import SamplingParams

    want = make_llm(tiny_llama, kv_cache_memory="16MiB").generate(
        "w1 w2 w3 w4", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert got.choices[0].text == want
    chat = oai.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "w5 w6"}])
    assert chat.usage.completion_tokens == 6


def test_sigterm_stops_every_rank(tiny_llama):
    server = ServerProcess(tiny_llama, "-tp", "2", "--distributed-timeout", "30")
    server.wait_healthy(timeout=180)
    worker = _worker_pid(server)
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(60)
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log()
    server.stop()
    assert code == 0, log
    assert not _alive(worker), "the worker rank outlived the server"


def _fail_worker_mid_request(sig: int, timeout_s: str) -> tuple[int, float, str, dict]:
    """Serve the demo model with ``-tp 2``, start a long completion, send ``sig`` to the
    worker rank while it runs. Returns (the server's exit code, seconds from the signal to its
    exit, its log, what the in-flight request got)."""
    from tests.server.conftest import demo_model

    server = ServerProcess(demo_model(), "-tp", "2", "--distributed-timeout", timeout_s,
                           "--step-delay", "0.05")
    got: dict = {}
    try:
        server.wait_healthy(timeout=180)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200, server.log()
        worker = _worker_pid(server)

        def request() -> None:
            try:
                r = httpx.post(f"{server.url}/v1/completions", timeout=90, json={
                    "model": "tiny", "prompt": "The", "max_tokens": 1000, "ignore_eos": True})
                got["status"], got["body"] = r.status_code, r.text
            except httpx.HTTPError as e:  # a hang would end here (90 s), not in an answer
                got["error"] = repr(e)

        t = threading.Thread(target=request)
        t.start()
        time.sleep(2.0)  # the request is decoding (50 ms per step, 1000 tokens)
        health_before = httpx.get(f"{server.url}/health", timeout=5).status_code
        os.kill(worker, sig)
        t0 = time.monotonic()
        try:
            code = server.proc.wait(int(timeout_s) + 45)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        t.join(30)
        got["health_before"] = health_before
        if sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)  # if the server failed to
        return code, took, server.log(), got
    finally:
        server.stop()


def test_killed_worker_fails_the_request_and_exits_nonzero():
    """SIGKILL the worker rank mid-request: the request gets an error answer (not a hang),
    /health stops answering 200, and the server exits 1 naming the dead rank."""
    code, took, log, got = _fail_worker_mid_request(signal.SIGKILL, "30")
    assert got["health_before"] == 200
    assert code == 1, f"exit code {code} after {took:.1f}s\n{log}"
    assert took < 30, log  # a dead peer fails the collective at once, not at the timeout
    assert got.get("status") == 500 and "engine_dead" in got["body"], (got, log)
    assert "worker rank 1" in log and "exited with code -9" in log, log
    assert "exiting with status 1" in log, log


def test_hung_worker_times_out_and_exits_nonzero():
    """SIGSTOP the worker rank mid-request (a hang, not a death): the driver's collective
    times out after --distributed-timeout, the request gets an error answer and the server
    exits 1, its log naming the stopped rank."""
    code, took, log, got = _fail_worker_mid_request(signal.SIGSTOP, "5")
    assert code == 1, f"exit code {code} after {took:.1f}s\n{log}"
    assert 4 < took < 40, log
    assert got.get("status") == 500 and "engine_dead" in got["body"], (got, log)
    assert "rank 1" in log and "stopped" in log, log
    assert "exiting with status 1" in log, log


def test_killed_idle_worker_makes_health_fail_and_exit(tiny_llama):
    """An idle server notices a dead worker too (no request needed): /health stops answering
    200 and the process exits 1."""
    server = ServerProcess(tiny_llama, "-tp", "2", "--distributed-timeout", "5")
    try:
        server.wait_healthy(timeout=180)
        time.sleep(8)  # idle past the collective timeout: an idle engine is not a dead one
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200, server.log()
        os.kill(_worker_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 30
        status = 200
        while time.monotonic() < deadline and status == 200:
            try:
                status = httpx.get(f"{server.url}/health", timeout=5).status_code
            except httpx.HTTPError:
                status = -1  # the server already exited
            time.sleep(0.2)
        assert status != 200, server.log()
        assert server.proc.wait(30) == 1, server.log()
        assert "worker rank 1" in server.log()
    finally:
        server.stop()
