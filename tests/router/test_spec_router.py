"""Speculative decoding behind the router and on the decode side of PD (demo model, separate
processes on loopback): a prefill replica and a decode replica that speculates (suffix drafts,
``adaptive`` off so every proposal is verified) behind the router answer exactly what a replica
without speculation answers -- greedy completions and chat, streamed and not, logprobs, stop
strings, n > 1 (sent whole to the decode replica: prefill and decode there, with drafts); the
decode replica really accepted drafts; no block is left in use. Every process is stopped at
the end."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvserve.engine.arg_utils import demo_model_path
from tests.router.test_router_processes import AUTH, KEY, REPLICA_KEY, Proc, wait_for
from tests.server.conftest import metric

pytestmark = [pytest.mark.slow]

SPEC = json.dumps({"method": "suffix", "num_speculative_tokens": 6, "adaptive": False})
REP = {"Authorization": f"Bearer {REPLICA_KEY}"}
LOOP = "PyObject_GetAttr(o, name) returns a new reference. " * 6


def _replica(*args: str) -> Proc:
    return Proc("serve", demo_model_path(), "--api-key", REPLICA_KEY, "--kv-cache-memory",
                "16MiB", "--served-model-name", "demo", "--kv-cache-dtype", "int8", "--dtype",
                "bf16", *args)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[tuple[Proc, Proc, Proc]]:
    d = str(tmp_path_factory.mktemp("kvx"))
    pd = ("--kv-transfer", "dir", "--kv-transfer-dir", d, "--kv-transfer-timeout", "5")
    procs = [_replica()]  # the reference: no speculation, no PD
    router = None
    try:
        procs.append(_replica("--role", "prefill", *pd))
        procs.append(_replica("--role", "decode", "--speculative-config", SPEC, *pd))
        router = Proc("router", "--prefill", procs[1].url, "--decode", procs[2].url,
                      "--api-key", KEY, "--replica-api-key", REPLICA_KEY, "--tokenizer",
                      "demo", "--health-interval", "0.2", "--health-timeout", "2",
                      "--fail-after", "2")

        def ready() -> bool:
            if httpx.get(f"{procs[0].url}/health", timeout=5).status_code != 200:
                return False
            j = httpx.get(f"{router.url}/router/replicas", headers=AUTH, timeout=5).json()
            return all(r["healthy"] for r in j["replicas"] + j["prefill_replicas"])

        wait_for(ready, 180, "the replicas up and in the router's pool")
        yield router, procs[0], procs[2]
    finally:
        for p in ([router] if router else []) + procs:
            p.stop()


CASES = [
    ("/v1/completions", {"prompt": LOOP, "max_tokens": 40, "temperature": 0, "logprobs": 2,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": LOOP + "The capital of France is", "max_tokens": 30,
                         "temperature": 0, "stop": [" the"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Repeat: " + LOOP}],
                              "max_tokens": 32, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/completions", {"prompt": LOOP, "max_tokens": 24, "temperature": 0, "n": 2,
                         "ignore_eos": True}),
]


def _text(r: httpx.Response) -> dict[int, str]:
    """Each choice's streamed text (with n > 1 the choices' chunks interleave as they come:
    with drafts a step sends several tokens at once)."""
    out: dict[int, str] = {}
    for x in r.text.splitlines():
        if x.startswith("data: ") and x != "data: [DONE]":
            for c in json.loads(x[6:])["choices"]:
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                out[c["index"]] = out.get(c["index"], "") + piece
    return out


def test_speculation_through_the_router_and_pd_equals_off(fleet) -> None:
    router, off, dec = fleet
    for path, body in CASES:
        want = httpx.post(f"{off.url}{path}", json=body, headers=REP, timeout=120)
        got = httpx.post(f"{router.url}{path}", json=body, headers=AUTH, timeout=120)
        assert want.status_code == got.status_code == 200, got.text
        w, g = want.json(), got.json()
        assert g["choices"] == w["choices"]
        assert g["usage"]["completion_tokens"] == w["usage"]["completion_tokens"]
        ws = httpx.post(f"{off.url}{path}", json={**body, "stream": True}, headers=REP,
                        timeout=120)
        gs = httpx.post(f"{router.url}{path}", json={**body, "stream": True}, headers=AUTH,
                        timeout=120)
        assert gs.status_code == 200 and gs.text.rstrip().endswith("data: [DONE]")
        assert _text(gs) == _text(ws)
    m = httpx.get(f"{dec.url}/metrics", timeout=5).text
    assert metric(m, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert metric(m, "kvserve_kv_transfer_blocks_installed_total") > 0  # PD really ran
    rm = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert metric(rm, 'kvserve_router_disaggregated_total{how="split"}') == 6
    wait_for(lambda: metric(httpx.get(f"{dec.url}/metrics", timeout=5).text,
                            "kvserve_kv_blocks_used") == 0, 30, "the decode replica idle")
