"""The router in front of real replicas (demo model, separate processes on loopback):
refused keys, sessions that stick and move only when their replica leaves, a shared prefix
routed to the replica holding it, and a replica killed mid-run: no request that had not
started on it is lost, the streams it carried end with an error event and [DONE], and it
rejoins when it comes back. Every process is stopped at the end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import pytest

from kvserve.engine.arg_utils import demo_model_path
from kvserve.router.launch import PortReservation
from tests.server.conftest import metric

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.isfile(os.path.join(demo_model_path(), "model.safetensors")),
    reason="demo model not present")]

KEY = "sk-router-test"
REPLICA_KEY = "sk-replica-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Proc:
    def __init__(self, *args: str, port: int | None = None) -> None:
        # a port of its own is held until stop (a restart binds it again); a given one is the
        # caller's
        self._port = PortReservation() if port is None else None
        self.port = port or self._port.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives with the process
            "w+", prefix="kvserve-router-test-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("KVSERVE_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", *self.args,
                                      "--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)
        if self._port is not None:
            self._port.close()


def replica(port: int | None = None) -> Proc:
    return Proc("serve", demo_model_path(), "--api-key", REPLICA_KEY, "--kv-cache-memory",
                "16MiB", "--served-model-name", "demo", "--max-num-seqs", "1",
                "--step-delay", "0.03", "--kv-events-endpoint", "tcp://127.0.0.1:0",
                "--kv-events-replay-endpoint", "tcp://127.0.0.1:0", port=port)


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if pred():
                return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def replicas_json(router: Proc) -> dict:
    return httpx.get(f"{router.url}/router/replicas", headers=AUTH, timeout=5).json()


def decisions(router: Proc, reason: str, replica: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    name = f'kvserve_router_routing_decisions_total{{reason="{reason}",replica="{replica}"}}'
    with contextlib.suppress(KeyError):
        return metric(text, name)
    return 0.0


def healthy_count(router: Proc) -> int:
    return sum(r["healthy"] for r in replicas_json(router)["replicas"])


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Proc, list[Proc]]]:
    reps = [replica(), replica()]
    router = None
    try:
        router = Proc("router", *[a for r in reps for a in ("--replica", r.url)],
                      "--api-key", KEY, "--replica-api-key", REPLICA_KEY, "--tokenizer",
                      "demo", "--health-interval", "0.2", "--health-timeout", "1",
                      "--fail-after", "2")
        wait_for(lambda: healthy_count(router) == 2, 180, "both replicas in the pool")
        yield router, reps
    finally:
        for p in ([router] if router else []) + reps:
            p.stop()


def complete(router: Proc, prompt: str, session: str | None = None,
             max_tokens: int = 2) -> httpx.Response:
    headers = dict(AUTH)
    if session:
        headers["x-session-affinity"] = session
    return httpx.post(f"{router.url}/v1/completions", headers=headers, timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_bad_or_missing_key_is_refused(cluster) -> None:
    router, _ = cluster
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": REPLICA_KEY}):
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    r = complete(router, "hello")
    assert r.status_code == 200, r.text
    assert r.headers["x-kvserve-replica"] in ("r0", "r1")


def test_shared_prefix_goes_to_the_replica_holding_it(cluster) -> None:
    router, _ = cluster
    doc = " ".join(f"Paragraph {i}: the shared document says something." for i in range(30))
    first = complete(router, doc + " Question one?")
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvserve-replica"]
    wait_for(lambda: next(r for r in replicas_json(router)["replicas"]
                          if r["name"] == holder)["indexed_blocks"] >= 10, 10,
             "the router to index the document")
    before = decisions(router, "prefix", holder)
    for q in ("two", "three", "four"):
        r = complete(router, doc + f" Question {q}?")
        assert r.status_code == 200 and r.headers["x-kvserve-replica"] == holder
    assert decisions(router, "prefix", holder) - before == 3


def _stream(router: Proc, prompt: str, max_tokens: int, session: str | None = None):
    async def go() -> tuple[int, str | None, list[str]]:
        headers = dict(AUTH)
        if session:
            headers["x-session-affinity"] = session
        async with httpx.AsyncClient(timeout=120) as c, c.stream(
                "POST", f"{router.url}/v1/completions", headers=headers,
                json={"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                      "ignore_eos": True, "temperature": 0}) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return r.status_code, r.headers.get("x-kvserve-replica"), lines
    return go()


def test_session_sticks_then_moves_only_when_its_replica_leaves_and_kill_loses_nothing(
        cluster) -> None:
    router, reps = cluster
    sessions = [f"user-{i}" for i in range(8)]
    home = {}
    for s in sessions:  # one request at a time: no load, pure consistent hashing
        r = complete(router, f"hello from {s}", session=s)
        assert r.status_code == 200
        home[s] = r.headers["x-kvserve-replica"]
    for s in sessions:  # sticks
        assert complete(router, f"again from {s}", session=s).headers[
            "x-kvserve-replica"] == home[s]
    assert set(home.values()) == {"r0", "r1"}, "8 sessions all hashed to one replica"

    # Kill r0 while it runs one stream and has more queued (--max-num-seqs 1).
    victim, survivor = reps[0], reps[1]
    retries_before = decisions(router, "retry", "r1")

    async def scenario():
        tasks = [asyncio.ensure_future(_stream(router, f"story {i}:", 40)) for i in range(6)]
        await asyncio.sleep(0)
        # once r0 has a stream running, kill it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reps_state = replicas_json(router)["replicas"]
            if reps_state[0]["inflight"] >= 2 and reps_state[1]["inflight"] >= 1:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the first stream on r0 is under way
        victim.proc.send_signal(signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    errors = 0
    for status, rep, lines in results:
        assert status == 200  # nothing bare: every request answered
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(x[6:]) for x in lines[:-1]]
        if any("error" in e for e in events):
            errors += 1
            assert rep == "r0" and events[-1]["error"]["code"] == "replica_failed"
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert errors <= 1, "only the stream running on the killed replica may fail"
    assert decisions(router, "retry", "r1") > retries_before, \
        "the requests queued on the killed replica were re-routed"
    wait_for(lambda: healthy_count(router) == 1, 10, "the dead replica to leave the pool")
    # sessions: those of r1 stay, those of r0 move to r1
    for s in sessions:
        assert complete(router, f"now {s}", session=s).headers["x-kvserve-replica"] == "r1"
    # it comes back on the same port and rejoins; its sessions go home again
    victim.start()
    wait_for(lambda: healthy_count(router) == 2, 180, "the replica to rejoin")
    for s in sessions:
        assert complete(router, f"back {s}", session=s).headers["x-kvserve-replica"] == home[s]
    assert survivor.proc.poll() is None


def test_a_hung_replica_leaves_within_seconds_and_rejoins(cluster) -> None:
    router, reps = cluster
    wait_for(lambda: healthy_count(router) == 2, 60, "both replicas in the pool")
    hung = reps[1]
    hung.proc.send_signal(signal.SIGSTOP)  # alive but answering nothing
    try:
        t0 = time.monotonic()
        wait_for(lambda: healthy_count(router) == 1, 15, "the hung replica to leave")
        assert time.monotonic() - t0 < 10
        for i in range(3):  # everything goes to the other one meanwhile
            r = complete(router, f"while r1 hangs {i}", session=f"user-{i}")
            assert r.status_code == 200 and r.headers["x-kvserve-replica"] == "r0"
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: healthy_count(router) == 2, 30, "the replica to rejoin")
