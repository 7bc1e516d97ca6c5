"""Disaggregation through the router (demo model, 1 prefill + 1 decode replica, separate
processes on loopback, a tmpfs-like shared directory): the client sees what a colocated
replica answers -- completions and chat, streamed and not, logprobs, stop strings, usage,
n > 1 (sent whole to the decode replica); the KV moved and was verified; a prefill replica
killed mid-run costs nothing but a local prefill; no block leaked on either side. Every
process is stopped at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvserve.engine.arg_utils import demo_model_path
from tests.router.test_router_processes import AUTH, KEY, REPLICA_KEY, Proc, wait_for
from tests.server.conftest import metric

pytestmark = [pytest.mark.slow]


def _replica(role: str, directory: str) -> Proc:
    return Proc("serve", demo_model_path(), "--api-key", REPLICA_KEY, "--kv-cache-memory",
                "16MiB", "--served-model-name", "demo", "--role", role, "--kv-transfer", "dir",
                "--kv-transfer-dir", directory, "--kv-transfer-timeout", "5",
                "--kv-cache-dtype", "int8")


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[tuple[Proc, Proc, Proc]]:
    d = str(tmp_path_factory.mktemp("kvx"))
    pre, dec = _replica("prefill", d), _replica("decode", d)
    router = None
    try:
        router = Proc("router", "--prefill", pre.url, "--decode", dec.url, "--api-key", KEY,
                      "--replica-api-key", REPLICA_KEY, "--tokenizer", "demo",
                      "--health-interval", "0.2", "--health-timeout", "2", "--fail-after", "2")

        def ready() -> bool:
            j = httpx.get(f"{router.url}/router/replicas", headers=AUTH, timeout=5).json()
            return all(r["healthy"] for r in j["replicas"] + j["prefill_replicas"])

        wait_for(ready, 180, "prefill and decode replicas in the pool")
        yield router, pre, dec
    finally:
        for p in ([router] if router else []) + [pre, dec]:
            p.stop()


REP = {"Authorization": f"Bearer {REPLICA_KEY}"}
CASES = [
    ("/v1/completions", {"prompt": "Once upon a time there was a little cat who lived in a "
                         "big house near the river and", "max_tokens": 12, "temperature": 0,
                         "logprobs": 2}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 20,
                         "temperature": 0, "stop": [" the"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a short poem "
                                            "about the sea."}], "max_tokens": 12,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "Two cats and", "max_tokens": 6, "temperature": 0,
                         "n": 2}),
]


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(x[6:]) for x in r.text.splitlines()
            if x.startswith("data: ") and x != "data: [DONE]"]


def _same(a: dict, b: dict) -> None:
    assert a["choices"] == b["choices"] and a["usage"] == b["usage"]


def _metric(proc: Proc, name: str) -> float:
    return metric(httpx.get(f"{proc.url}/metrics", timeout=5).text, name)


def test_router_split_equals_colocated(pd) -> None:
    router, pre, dec = pd
    for path, body in CASES:
        # the decode replica alone (no leg) is the colocated reference
        want = httpx.post(f"{dec.url}{path}", json=body, headers=REP, timeout=120).json()
        got = httpx.post(f"{router.url}{path}", json=body, headers=AUTH, timeout=120)
        assert got.status_code == 200, got.text
        _same(got.json(), want)
        ws = httpx.post(f"{dec.url}{path}", json={**body, "stream": True,
                        "stream_options": {"include_usage": True}}, headers=REP, timeout=120)
        gs = httpx.post(f"{router.url}{path}", json={**body, "stream": True,
                        "stream_options": {"include_usage": True}}, headers=AUTH, timeout=120)
        assert gs.status_code == 200 and gs.text.rstrip().endswith("data: [DONE]")

        def text(evs):
            return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                           for e in evs for c in e["choices"])
        assert text(_events(gs)) == text(_events(ws))
        assert _events(gs)[-1]["usage"] == _events(ws)[-1]["usage"]
        # the prompt ran before on the replica that prefilled it (the prefill replica when
        # split): its whole blocks are cached tokens, passed through by the router
        u = _events(gs)[-1]["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] == (u["prompt_tokens"] - 1) // 16 * 16
    m = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert metric(m, 'kvserve_router_disaggregated_total{how="split"}') == 6
    assert metric(m, 'kvserve_router_disaggregated_total{how="whole"}') == 2  # n = 2
    assert _metric(dec, "kvserve_kv_transfer_blocks_installed_total") > 0
    assert _metric(pre, "kvserve_kv_transfer_exported_total") == 6

    def idle() -> bool:
        return (_metric(pre, "kvserve_kv_transfer_outstanding") == 0
                and _metric(pre, "kvserve_kv_blocks_used") == 0
                and _metric(dec, "kvserve_kv_blocks_used") == 0)

    wait_for(idle, 30, "no transfer outstanding, no block in use on either side")


def test_prefill_replica_killed(pd) -> None:
    router, pre, dec = pd
    path, body = CASES[0]
    want = httpx.post(f"{dec.url}{path}", json=body, headers=REP, timeout=120).json()
    pre.proc.kill()
    pre.proc.wait(10)
    got = httpx.post(f"{router.url}{path}", json=body, headers=AUTH, timeout=120)
    assert got.status_code == 200, got.text
    _same(got.json(), want)  # the decode replica took it whole
    wait_for(lambda: _metric(dec, "kvserve_kv_blocks_used") == 0, 30, "decode replica idle")


def test_serve_data_parallel_with_prefill_replicas() -> None:
    """``serve -dp 2 --prefill-replicas 1``: one prefill and one decode replica behind one
    endpoint, the KV through a shared directory the command made (and removes)."""
    import signal

    server = Proc("serve", demo_model_path(), "--data-parallel-size", "2",
                  "--prefill-replicas", "1", "--replica-threads", "1", "--api-key", "ck",
                  "--kv-cache-memory", "16MiB", "--health-interval", "0.2")
    auth = {"Authorization": "Bearer ck"}
    try:
        def ready() -> bool:
            j = httpx.get(f"{server.url}/router/replicas", headers=auth, timeout=2).json()
            return all(r["healthy"] for r in j["replicas"] + j["prefill_replicas"])

        wait_for(ready, 240, "prefill and decode replicas ready")
        r = httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=120,
                       json={"prompt": "Hello there, my friend", "max_tokens": 4,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["text"]) > 0
        m = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert metric(m, 'kvserve_router_disaggregated_total{how="split"}') == 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
