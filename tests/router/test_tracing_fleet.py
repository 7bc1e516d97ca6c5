"""One request's trace across ``serve -dp 2 --prefill-replicas 1 --otlp-traces-endpoint``
(demo model; the router and both replicas are processes on loopback, the OTLP receiver runs
in this test): one trace id, the client's span its root; router SERVER span -> a CLIENT span
per leg -> the prefill replica's span (queue, prefill, KV export) and the decode replica's
(KV import linked to the prefill span, queue, prefill, decode). Every process is stopped."""

from __future__ import annotations

import json
import secrets
import signal

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.proto")

from kvserve.bench.otlp_receiver import OTLPReceiver, tree  # noqa: E402
from kvserve.engine.arg_utils import demo_model_path  # noqa: E402
from tests.router.test_router_processes import Proc, wait_for  # noqa: E402

pytestmark = [pytest.mark.slow]
SHOWN = ("kvserve.leg", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
         "kvserve.kv_transfer.bytes", "kvserve.cached_tokens")


def test_one_request_across_router_prefill_transfer_decode(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the children export promptly
    rx = OTLPReceiver()
    server = Proc("serve", demo_model_path(), "--data-parallel-size", "2",
                  "--prefill-replicas", "1", "--replica-threads", "1", "--api-key", "ck",
                  "--kv-cache-memory", "16MiB", "--health-interval", "0.2",
                  "--otlp-traces-endpoint", rx.endpoint)
    auth = {"Authorization": "Bearer ck"}
    try:
        def ready() -> bool:
            j = httpx.get(f"{server.url}/router/replicas", headers=auth, timeout=2).json()
            return all(r["healthy"] for r in j["replicas"] + j["prefill_replicas"])

        wait_for(ready, 240, "prefill and decode replicas ready")
        tid, sid = secrets.token_hex(16), secrets.token_hex(8)
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                       headers={**auth, "traceparent": f"00-{tid}-{sid}-01"},
                       json={"messages": [{"role": "user", "content": "Tell me about the "
                                           "sea and the ships on it"}],
                             "max_tokens": 5, "temperature": 0, "stream": True,
                             "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        usage = [json.loads(line[6:]) for line in r.text.splitlines()
                 if line.startswith("data: {")][-1]["usage"]

        def complete(spans) -> bool:
            mine = [s for s in spans if s.trace_id == tid]
            return (sum(s.kind == "SERVER" for s in mine) == 3
                    and any(s.name == "kvserve.decode" for s in mine)
                    and any(s.name == "kvserve.kv_transfer.export" for s in mine))

        spans = rx.wait_for(complete, 30)
        assert {s.trace_id for s in spans} == {tid}  # one trace: nothing else was sent
        print(tree(spans, SHOWN))
        by_id = {s.span_id: s for s in spans}
        (router,) = [s for s in spans if s.service == "kvserve-router" and s.kind == "SERVER"]
        assert router.parent_id == sid and router.name == "POST /v1/chat/completions"
        legs = {s.attributes["kvserve.leg"]: s for s in spans if s.kind == "CLIENT"}
        assert set(legs) == {"prefill", "decode"}
        assert all(s.parent_id == router.span_id and s.service == "kvserve-router"
                   for s in legs.values())
        replicas = {s.attributes["kvserve.role"]: s for s in spans
                    if s.kind == "SERVER" and s.service == "kvserve"}
        assert set(replicas) == {"prefill", "decode"}
        pre, dec = replicas["prefill"], replicas["decode"]
        assert pre.parent_id == legs["prefill"].span_id
        assert dec.parent_id == legs["decode"].span_id
        assert legs["prefill"].end_ns <= legs["decode"].start_ns  # prefill, then decode
        for s in (pre, dec):
            assert s.name == f"chat {s.attributes['gen_ai.response.model']}"
            assert s.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert dec.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
        assert pre.attributes["gen_ai.usage.output_tokens"] == 1  # the first token only

        def children(span) -> set[str]:
            return {s.name for s in spans if s.parent_id == span.span_id}

        assert children(pre) == {"kvserve.queue", "kvserve.prefill",
                                 "kvserve.kv_transfer.export"}
        # the decode replica ran no prefill: its first token came with the KV
        assert children(dec) == {"kvserve.kv_transfer.import", "kvserve.queue",
                                 "kvserve.decode"}
        (exp,) = [s for s in spans if s.name == "kvserve.kv_transfer.export"]
        (imp,) = [s for s in spans if s.name == "kvserve.kv_transfer.import"]
        assert imp.links == ((tid, pre.span_id),)  # the traceparent came with the handle
        assert exp.attributes["kvserve.kv_transfer.bytes"] == \
            imp.attributes["kvserve.kv_transfer.bytes"] > 0
        assert exp.end_ns <= imp.start_ns + 5_000_000  # clocks of one host
        # every parent present: the tree is whole (the client's span is the only outside one)
        assert all(s.parent_id in by_id or s is router for s in spans)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
        rx.close()
