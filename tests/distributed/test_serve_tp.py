"""``kvserve serve -tp 2``: answers OpenAI-client requests like the single-process engine,
SIGTERM stops every rank, and a killed worker turns /health unhealthy (no silent hang)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess


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


def test_killed_worker_makes_health_fail(tiny_llama):
    server = ServerProcess(tiny_llama, "-tp", "2", "--distributed-timeout", "5")
    try:
        server.wait_healthy(timeout=180)
        time.sleep(8)  # idle past the collective timeout: an idle engine is not a dead one
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200, server.log()
        os.kill(_worker_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 30
        status = 200
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.url}/health", timeout=5).status_code
            if status != 200:
                break
            time.sleep(0.5)
        assert status == 503, server.log()
        assert "worker rank 1" in server.log()
    finally:
        server.stop()
