"""Server test fixtures: real ``kvserve serve`` subprocesses and in-process ASGI apps.

Most servers use the session's tiny random Llama (word-level vocabulary ``w0``..``w508``) with
a 16 MiB KV cache; ``demo_server`` and the servers some tests start for themselves serve the
built-in demo model (a byte-level BPE tokenizer that adds ``<|bos|>``, 2,048-token context).
``--step-delay`` slows engine steps a little so streams last long enough to be interrupted
deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from kvserve.router.launch import PortReservation

API_KEY = "sk-kvserve-test"
MODEL_NAME = "tiny"
MAIN_SERVER_ARGS = ("--api-key", API_KEY, "--max-body-bytes", "65536", "--step-delay", "0.003",
                    "--max-num-seqs", "64", "--max-queue", "256", "--request-timeout", "120")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "server_shutdown: stops the shared server; runs last")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that shut the shared server down run after everything else (stable order)."""
    items.sort(key=lambda item: item.get_closest_marker("server_shutdown") is not None)


class ServerProcess:
    """``python -m kvserve.cli serve MODEL --port P ...`` as a subprocess."""

    def __init__(self, model: str, *args: str) -> None:
        self._port = PortReservation()  # held until stop: no other bind takes it meanwhile
        self.port = self._port.port
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            "w+", prefix="kvserve-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", model, "--port", str(self.port),
               "--kv-cache-memory", "16MiB", "--served-model-name", MODEL_NAME, *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("KVSERVE_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()

    def wait_healthy(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        os.unlink(self._log.name)
        self._port.close()


@pytest.fixture(scope="session")
def main_server(tiny_llama) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_llama, *MAIN_SERVER_ARGS)
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def demo_model() -> str:
    from kvserve.engine.arg_utils import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="session")
def demo_server() -> Iterator[ServerProcess]:
    """The demo model with the default server settings (4 MiB body limit, no API key)."""
    server = ServerProcess(demo_model(), "--step-delay", "0.002")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.fixture
def client(main_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=main_server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def assert_ok(client: httpx.Client) -> None:
    """A normal request still succeeds (run after every bad one)."""
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "w1 w2 w3",
                                             "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(get_metrics, timeout: float = 15.0) -> str:
    """Poll until no request runs or waits and no KV block is in use; returns the metrics."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = get_metrics()
        if (metric(text, "kvserve_num_requests_running") == 0
                and metric(text, "kvserve_num_requests_waiting") == 0
                and metric(text, "kvserve_kv_blocks_used") == 0):
            return text
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {timeout} s:\n{text}")


class InProcess:
    """An ``AsyncLLMEngine`` + ``build_app`` in this process, for ``httpx.ASGITransport``."""

    def __init__(self, model: str, settings_kw: dict, engine_kw: dict,
                 step_delay_s: float = 0.0) -> None:
        from kvserve.engine.arg_utils import EngineArgs
        from kvserve.engine.async_engine import AsyncLLMEngine
        from kvserve.server.api import build_app
        from kvserve.server.settings import ServerSettings

        args = EngineArgs(model=model, kv_cache_memory="16MiB", progress=False, **engine_kw)
        self.engine = AsyncLLMEngine.from_engine_args(args, step_delay_s=step_delay_s).start()
        self.app = build_app(self.engine, ServerSettings(served_model_name=MODEL_NAME,
                                                         **settings_kw))
        self.state = self.app.state.server

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                 base_url="http://test", timeout=60)

    def run(self, coro) -> object:
        return asyncio.run(coro)

    def close(self) -> None:
        self.engine.shutdown()
        self.state.close()


@pytest.fixture
def inprocess(tiny_llama):
    made: list[InProcess] = []

    def make(step_delay_s: float = 0.0, engine_kw: dict | None = None,
             **settings_kw) -> InProcess:
        srv = InProcess(tiny_llama, settings_kw, engine_kw or {}, step_delay_s)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()
