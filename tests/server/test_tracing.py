"""OpenTelemetry tracing of one replica (kvserve/http/tracing.py), in process: an OTLP
receiver on loopback (kvserve/bench/otlp_receiver.py, decoding with opentelemetry-proto) gets
the span of a request that continues the client's ``traceparent``, with gen_ai attributes
equal to the response's and a child span per engine phase; a prefill leg and a decode leg join
one trace through the traceparent carried with the KV handle; with tracing off neither the SDK
nor the tracing module is imported."""

from __future__ import annotations

import secrets
import sys

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.proto")

from kvserve.bench.otlp_receiver import OTLPReceiver, tree  # noqa: E402
from tests.server.conftest import MODEL_NAME  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog and then"


def _traceparent() -> tuple[str, str, str]:
    tid, sid = secrets.token_hex(16), secrets.token_hex(8)
    return tid, sid, f"00-{tid}-{sid}-01"


@pytest.fixture
def rx():
    with OTLPReceiver() as r:
        yield r


def _flush(*servers) -> None:
    for s in servers:
        assert s.state.tracing.provider.force_flush(10_000)


@pytest.mark.parametrize("stream", [False, True])
def test_one_request_span_tree(inprocess, rx, stream) -> None:
    srv = inprocess(otlp_traces_endpoint=rx.endpoint)
    tid, sid, tp = _traceparent()
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}

    async def go():
        async with srv.client() as c:
            r = await c.post("/v1/completions", json=body, headers={"traceparent": tp})
            assert r.status_code == 200, r.text
            if not stream:
                return r.json()
            import json
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return chunks[-1]

    answer = srv.run(go())
    _flush(srv)
    spans = rx.wait_for(lambda s: any(x.kind == "SERVER" for x in s), 10)
    assert {s.trace_id for s in spans} == {tid}
    (server,) = [s for s in spans if s.kind == "SERVER"]
    assert server.parent_id == sid  # the client's span
    assert server.name == f"text_completion {MODEL_NAME}" and server.service == "kvserve"
    a = server.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.response.id"] == answer["id"]
    assert a["gen_ai.request.model"] == MODEL_NAME
    assert a["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["kvserve.stream"] is stream
    assert 0 < a["gen_ai.server.time_to_first_token"] <= a["gen_ai.server.request.duration"]
    assert a["kvserve.queue_time"] >= 0 and a["gen_ai.usage.cache_read.input_tokens"] >= 0
    children = {s.name: s for s in spans if s.parent_id == server.span_id}
    assert set(children) == {"kvserve.queue", "kvserve.prefill", "kvserve.decode"}
    q, p, d = (children[n] for n in ("kvserve.queue", "kvserve.prefill", "kvserve.decode"))
    assert server.start_ns <= q.start_ns <= q.end_ns <= p.start_ns + 1000
    assert p.end_ns <= d.start_ns + 1000 and d.end_ns <= server.end_ns + 1000
    assert len(spans) == 4, tree(spans)


def test_grpc_protocol(inprocess) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    with OTLPReceiver(grpc=True) as rx:
        srv = inprocess(otlp_traces_endpoint=rx.grpc_endpoint, otlp_traces_protocol="grpc")
        tid, sid, tp = _traceparent()

        async def go():
            async with srv.client() as c:
                r = await c.post("/v1/completions", headers={"traceparent": tp}, json={
                    "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})
                assert r.status_code == 200, r.text

        srv.run(go())
        _flush(srv)
        spans = rx.wait_for(lambda s: any(x.kind == "SERVER" for x in s), 10)
        (server,) = [s for s in spans if s.kind == "SERVER"]
        assert server.trace_id == tid and server.parent_id == sid
        assert {s.trace_id for s in spans} == {tid} and len(spans) >= 3


def test_no_traceparent_is_a_new_root(inprocess, rx) -> None:
    srv = inprocess(otlp_traces_endpoint=rx.endpoint)

    async def go():
        async with srv.client() as c:
            r = await c.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            # refused once admitted (longer than the context): an error span
            r = await c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                                                      "max_tokens": 10**6})
            assert r.status_code == 400, r.text

    srv.run(go())
    _flush(srv)
    spans = rx.wait_for(lambda s: sum(x.kind == "SERVER" for x in s) == 2, 10)
    chat, bad = sorted((s for s in spans if s.kind == "SERVER"), key=lambda s: s.start_ns)
    assert chat.parent_id == "" and chat.name == f"chat {MODEL_NAME}"
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert bad.status == 2 and bad.trace_id != chat.trace_id  # a refused request: an error


def test_prefill_and_decode_legs_join_one_trace(inprocess, rx, tmp_path) -> None:
    """The prefill leg's answer carries its span's traceparent with the KV handle; the decode
    leg, sent with the router's CLIENT span context (here: the client's), links its transfer
    span to the prefill span; without a header it parents on the prefill span."""
    kw = {"kv_transfer": "dir", "kv_transfer_dir": str(tmp_path)}
    pre = inprocess(engine_kw=kw, role="prefill", otlp_traces_endpoint=rx.endpoint)
    dec = inprocess(engine_kw=kw, role="decode", otlp_traces_endpoint=rx.endpoint)
    tid, sid, tp = _traceparent()
    body = {"model": MODEL_NAME, "prompt": PROMPT * 4, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}

    async def go():
        legs = []
        async with pre.client() as p, dec.client() as d:
            for headers in ({"traceparent": tp}, {}):  # decode leg with / without a header
                r = await p.post("/v1/completions", headers={"traceparent": tp},
                                 json={**body, "kv_transfer": {"role": "prefill"}})
                assert r.status_code == 200, r.text
                leg = r.json()["kv_transfer"]
                assert leg["traceparent"].split("-")[1] == tid
                r = await d.post("/v1/completions", headers=headers,
                                 json={**body, "kv_transfer": {"role": "decode", **leg}})
                assert r.status_code == 200, r.text
                legs.append(leg)
        return legs

    legs = pre.run(go())
    _flush(pre, dec)
    spans = rx.wait_for(lambda s: sum(x.kind == "SERVER" for x in s) == 4, 10)
    assert {s.trace_id for s in spans} == {tid}, tree(spans)
    servers = sorted((s for s in spans if s.kind == "SERVER"), key=lambda s: s.start_ns)
    pre1, dec_hdr, pre2, dec_bare = servers
    assert [s.attributes["kvserve.role"] for s in servers] == ["prefill", "decode"] * 2
    assert [leg["traceparent"].split("-")[2] for leg in legs] == [pre1.span_id, pre2.span_id]
    assert dec_hdr.parent_id == sid and dec_bare.parent_id == pre2.span_id
    nbytes = legs[0]["handle"]["nbytes"]
    exports = [s for s in spans if s.name == "kvserve.kv_transfer.export"]
    assert [s.parent_id for s in exports] == [pre1.span_id, pre2.span_id]
    for s in exports:
        assert s.attributes["kvserve.kv_transfer.bytes"] == nbytes
        assert s.attributes["kvserve.kv_transfer.blocks"] == legs[0]["handle"]["num_blocks"]
    imports = [s for s in spans if s.name == "kvserve.kv_transfer.import"]
    assert [s.parent_id for s in imports] == [dec_hdr.span_id, dec_bare.span_id]
    assert [s.links for s in imports] == [((tid, pre1.span_id),), ((tid, pre2.span_id),)]
    for s in imports:
        assert s.attributes["kvserve.kv_transfer.bytes"] == nbytes
        assert s.attributes["kvserve.kv_transfer.blocks"] == legs[0]["handle"]["num_blocks"]
        assert "kvserve.kv_transfer.fallback" not in s.attributes
    assert dec_hdr.attributes["kvserve.kv_transfer.import.bytes"] == nbytes


def test_no_cost_when_off(inprocess, monkeypatch) -> None:
    """Tracing off: a request runs with the tracing module and the SDK unimportable (an
    import would raise), and no generation holds a trace."""
    for name in ("kvserve.http.tracing", "opentelemetry.sdk", "opentelemetry.sdk.trace"):
        monkeypatch.setitem(sys.modules, name, None)
    srv = inprocess()
    assert srv.state.tracing is None
    seen = []
    from kvserve.server import generation

    orig = generation.Generation.close

    def close(self):
        seen.append((self.trace, list(self.engine_metrics)))
        orig(self)

    monkeypatch.setattr(generation.Generation, "close", close)

    async def go():
        async with srv.client() as c:
            r = await c.post("/v1/completions", headers={"traceparent": _traceparent()[2]},
                             json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3})
            assert r.status_code == 200, r.text

    srv.run(go())
    # no trace; engine_metrics (references to the engine's RequestMetrics) is also what the
    # Prometheus request histograms read, so it is filled either way
    assert [trace for trace, _ in seen] == [None] and len(seen[0][1]) == 1


def test_settings_refuse_bad_endpoint_and_protocol(monkeypatch) -> None:
    import importlib.util

    from kvserve.server.settings import ServerSettings

    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerSettings(otlp_traces_endpoint="localhost:4318")
    with pytest.raises(ValueError, match="otlp_traces_protocol"):
        ServerSettings(otlp_traces_protocol="thrift")
    ServerSettings(otlp_traces_endpoint="grpc://127.0.0.1:4317", otlp_traces_protocol="grpc")
    # without the extra: refused when the settings are read, before any model loads
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "opentelemetry.sdk" else real(name, *a))
    with pytest.raises(ValueError, match=r"otlp_traces_endpoint needs .*kvserve\[otel\]"):
        ServerSettings(otlp_traces_endpoint="http://127.0.0.1:4318")
    ServerSettings()  # tracing off needs nothing


def test_phases_from_recorded_metrics() -> None:
    """RequestTrace.finish turns what the engine recorded into child spans: a tier restore
    with its blocks per tier, an integrity repair, a failed import's fallback reason."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvserve.http.tracing import RequestTrace, Tracing
    from kvserve.outputs import KVMove, RequestMetrics

    mem = InMemorySpanExporter()
    tr = Tracing("http://127.0.0.1:9/v1/traces", "http/protobuf", "kvserve", exporter=mem)
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                       last_token_time=12.0, finished_time=12.0, num_cached_tokens=32,
                       integrity_repairs=1,
                       kv_restores=[KVMove(10.1, 0.2, blocks=3,
                                           by_tier=(("memory", 1), ("disk", 2)))],
                       kv_import=KVMove(10.0, 0.05, fallback="timeout"))

    class Body:
        model, max_tokens, n, stream, kv_transfer = None, 8, 1, False, None

    rt = RequestTrace(tr, {}, "chat", "m", "decode", Body())
    rt.finish("chatcmpl-1", 10.0, [m], 40, 3, ["stop"])
    tr.shutdown()
    spans = {s.name: s for s in mem.get_finished_spans()}
    assert set(spans) == {"chat m", "kvserve.queue", "kvserve.kv_tier.restore",
                          "kvserve.kv_transfer.import", "kvserve.prefill", "kvserve.decode"}
    root = spans["chat m"].attributes
    assert root["kvserve.integrity_repairs"] == 1 and root["kvserve.cached_tokens"] == 32
    assert root["kvserve.kv_tier.blocks_restored.memory"] == 1
    assert root["kvserve.kv_tier.blocks_restored.disk"] == 2
    assert root["gen_ai.latency.time_in_queue"] == 0.5
    restore = spans["kvserve.kv_tier.restore"]
    assert restore.attributes["kvserve.kv_tier.blocks"] == 3
    assert (restore.end_time - restore.start_time) == pytest.approx(0.2e9, abs=1e3)
    assert spans["kvserve.kv_transfer.import"].attributes[
        "kvserve.kv_transfer.fallback"] == "timeout"
    assert all(s.parent.span_id == spans["chat m"].context.span_id
               for s in spans.values() if s.name != "chat m")


def test_speculation_acceptance_attributes(inprocess, rx) -> None:
    """With speculative decoding on, the server span and the decode span carry the request's
    drafts, draft tokens and accepted tokens (equal to the engine's counters for this one
    request), the acceptance rate and the mean accepted length; with it off, none of them."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "adaptive": False}
    srv = inprocess(otlp_traces_endpoint=rx.endpoint, engine_kw={"speculative_config": spec})
    # a prompt over many token ids: a one-token lookup finds nearly every sampled token in it
    body = {"model": MODEL_NAME, "prompt": list(range(3, 200)) * 2, "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}

    def complete(server_) -> None:
        async def go():
            async with server_.client() as c:
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text

        server_.run(go())
        _flush(server_)

    complete(srv)
    spans = rx.wait_for(lambda s: any(x.name == "kvserve.decode" for x in s), 10)
    (server,) = [s for s in spans if s.kind == "SERVER"]
    (decode,) = [s for s in spans if s.name == "kvserve.decode"]
    counters = srv.engine._engine.stats().spec_decode
    p = "kvserve.spec_decode."
    for a in (server.attributes, decode.attributes):
        assert a[f"{p}num_drafts"] == counters["num_drafts"] > 0
        assert a[f"{p}num_draft_tokens"] == counters["num_draft_tokens"]
        assert a[f"{p}num_accepted_tokens"] == counters["num_accepted_tokens"]
        assert a[f"{p}acceptance_rate"] == pytest.approx(
            counters["num_accepted_tokens"] / counters["num_draft_tokens"])
        assert a[f"{p}mean_accepted_length"] == pytest.approx(
            1 + counters["num_accepted_tokens"] / counters["num_drafts"])
    assert server.attributes["gen_ai.usage.output_tokens"] == 24

    complete(inprocess(otlp_traces_endpoint=rx.endpoint))
    spans = rx.wait_for(lambda s: sum(x.kind == "SERVER" for x in s) >= 2, 10)
    plain = [s for s in spans if s.kind == "SERVER" and s.span_id != server.span_id]
    assert plain and not any(k.startswith(p) for s in plain for k in s.attributes)


def test_speculation_attributes_from_recorded_metrics() -> None:
    """Several sequences (n > 1): their drafts add up on the server span, each decode span has
    its own; a request with none recorded has no such attribute."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvserve.http.tracing import RequestTrace, Tracing
    from kvserve.outputs import RequestMetrics, SpecDecodeUsage

    mem = InMemorySpanExporter()
    tr = Tracing("http://127.0.0.1:9/v1/traces", "http/protobuf", "kvserve", exporter=mem)

    def metrics(use):
        return RequestMetrics(arrival_time=10.0, first_scheduled_time=10.1,
                              first_token_time=10.2, last_token_time=11.0, finished_time=11.0,
                              spec_decode=use)

    class Body:
        model, max_tokens, n, stream, kv_transfer = None, 8, 2, False, None

    rt = RequestTrace(tr, {}, "text_completion", "m", "both", Body())
    rt.finish("cmpl-1", 10.0, [metrics(SpecDecodeUsage(4, 12, 9)),
                               metrics(SpecDecodeUsage(2, 4, 0))], 10, 30, ["length"] * 2)
    RequestTrace(tr, {}, "text_completion", "m", "both", Body()).finish(
        "cmpl-2", 10.0, [metrics(None)], 10, 3, ["length"])
    tr.shutdown()
    spans = mem.get_finished_spans()
    one = [s for s in spans if s.name == "text_completion m"
           and s.attributes["gen_ai.response.id"] == "cmpl-1"][0].attributes
    assert (one["kvserve.spec_decode.num_drafts"], one["kvserve.spec_decode.num_draft_tokens"],
            one["kvserve.spec_decode.num_accepted_tokens"]) == (6, 16, 9)
    assert one["kvserve.spec_decode.acceptance_rate"] == pytest.approx(9 / 16)
    assert one["kvserve.spec_decode.mean_accepted_length"] == pytest.approx(1 + 9 / 6)
    decodes = sorted(s.attributes.get("kvserve.spec_decode.num_accepted_tokens", -1)
                     for s in spans if s.name == "kvserve.decode")
    assert decodes == [-1, 0, 9]  # cmpl-2's decode span has none
    two = [s for s in spans if s.name == "text_completion m"
           and s.attributes["gen_ai.response.id"] == "cmpl-2"][0].attributes
    assert not any(k.startswith("kvserve.spec_decode.") for k in two)
