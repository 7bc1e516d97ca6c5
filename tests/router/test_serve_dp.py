"""``kvserve serve --data-parallel-size 2``: two replica processes behind the router in one
command, with the client key enforced at the router, both replicas serving, the replicas'
own key not the client's, and a SIGTERM that drains, stops the replicas and exits 0."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from kvserve.engine.arg_utils import demo_model_path
from tests.router.test_router_processes import Proc, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(  # slow: starts three processes
    not os.path.isfile(os.path.join(demo_model_path(), "model.safetensors")),
    reason="demo model not present")]


def test_serve_data_parallel_end_to_end() -> None:
    server = Proc("serve", demo_model_path(), "--data-parallel-size", "2", "--replica-threads",
                  "1", "--api-key", "client-key", "--kv-cache-memory", "16MiB",
                  "--health-interval", "0.2")
    auth = {"Authorization": "Bearer client-key"}
    try:
        def both() -> bool:
            r = httpx.get(f"{server.url}/ready", timeout=2)
            return r.status_code == 200 and r.json()["replicas"] == 2
        wait_for(both, 240, "two replicas ready")
        body = {"prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body,
                          timeout=60).status_code == 401
        seen = set()
        for i in range(4):
            r = httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=60,
                           json={**body, "prompt": f"Hello {i}"})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-kvserve-replica"])
        assert seen == {"r0", "r1"}  # ties between idle replicas rotate
        replicas = httpx.get(f"{server.url}/router/replicas", headers=auth,
                             timeout=5).json()["replicas"]
        for rep in replicas:  # loopback replicas refuse the client's key: only the router's
            r = httpx.post(f"{rep['url']}/v1/completions", headers=auth, json=body, timeout=30)
            assert r.status_code == 401
            assert rep["events_endpoint"].startswith("tcp://127.0.0.1:")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        time.sleep(0.5)
        for rep in replicas:  # the replicas are gone too
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{rep['url']}/health", timeout=2)
    finally:
        server.stop()


def test_data_parallel_replicas_each_tensor_parallel() -> None:
    """``-dp 2 -tp 2``: each replica is its own 2-rank tensor-parallel group (4 engine ranks),
    both serve, and greedy text equals one plain engine's on the same prompts."""
    from kvserve import LLM, SamplingParams

    prompts = ["Hello there", "The cat", "A list is", "Once upon"]
    llm = LLM(demo_model_path(), kv_cache_memory="16MiB")
    want = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8))]
    del llm
    server = Proc("serve", demo_model_path(), "--data-parallel-size", "2",
                  "--tensor-parallel-size", "2", "--replica-threads", "1",
                  "--kv-cache-memory", "16MiB", "--health-interval", "0.2")
    try:
        def both() -> bool:
            r = httpx.get(f"{server.url}/ready", timeout=2)
            return r.status_code == 200 and r.json()["replicas"] == 2
        wait_for(both, 300, "two tensor-parallel replicas ready")
        seen, got = set(), []
        for p in prompts:
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "prompt": p, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-kvserve-replica"])
            got.append(r.json()["choices"][0]["text"])
        assert seen == {"r0", "r1"}
        assert got == want
        assert "tensor parallel: 2 ranks" in server.text()
    finally:
        server.stop()
