"""OpenTelemetry traces of requests (``--otlp-traces-endpoint``; docs/server.md, "Tracing").

Imported only when tracing is on (``ServerState`` / ``RouterState`` import it lazily): with it
off, neither the OpenTelemetry SDK nor this module is loaded and no span work runs.

A client's W3C ``traceparent`` header is honoured: the router's SERVER span continues it, each
forward to a replica is a CLIENT span whose context goes on in the ``traceparent`` header, and
the replica's SERVER span continues that. A prefill leg's answer carries its span's
traceparent inside ``kv_transfer``, so the decode replica's transfer span links to it (and a
decode leg that came without a header parents on it).

The engine never imports OpenTelemetry: it records what happened on the request's
``RequestMetrics`` (monotonic times, KV moves); ``RequestTrace.finish`` turns them into child
spans after the fact. Attributes follow the gen_ai semantic conventions where they apply
(``gen_ai.*``; vLLM's ``gen_ai.latency.*`` too), the rest are ``kvserve.*``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as e:  # the optional extra is missing
    raise ValueError("otlp_traces_endpoint needs the OpenTelemetry SDK: pip install "
                     "'kvserve[otel]'") from e

from kvserve.outputs import KVMove, RequestMetrics

_PROPAGATOR = TraceContextTextMapPropagator()
SCOPE = "kvserve"


def make_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """An OTLP span exporter: ``http/protobuf`` posts to ``endpoint`` (``/v1/traces`` added
    when it has no path), ``grpc`` to ``host:port`` (``grpc://`` and ``http://``:
    plaintext)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not endpoint.startswith("https://")
        target = urlsplit(endpoint).netloc or endpoint
        return OTLPSpanExporter(endpoint=target, insecure=insecure)
    if protocol != "http/protobuf":
        raise ValueError(f"otlp_traces_protocol must be http/protobuf or grpc, got {protocol!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


def _ns(t: float, offset_ns: int) -> int:
    """A ``time.monotonic()`` reading as epoch nanoseconds (``offset_ns``: wall - monotonic)."""
    return int(t * 1e9) + offset_ns


def _offset_ns() -> int:
    return time.time_ns() - time.monotonic_ns()


class Tracing:
    """One process's tracer: its own provider (the global one is left alone, so FastAPI's
    own instrumentation stays off), a batch processor and the OTLP exporter."""

    def __init__(self, endpoint: str, protocol: str, service_name: str,
                 attributes: Mapping[str, Any] | None = None,
                 exporter: SpanExporter | None = None) -> None:
        resource = Resource.create({"service.name": service_name, **(attributes or {})})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter or make_exporter(endpoint, protocol)))
        self.tracer = self.provider.get_tracer(SCOPE)

    @staticmethod
    def context(headers: Mapping[str, str], fallback: str | None = None) -> otel_context.Context:
        """The parent context in ``headers`` (``traceparent`` / ``tracestate``), else in
        ``fallback`` (a traceparent string), else a new root."""
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        if not carrier and fallback:
            carrier = {"traceparent": fallback}
        return _PROPAGATOR.extract(carrier)

    @staticmethod
    def traceparent(span: trace.Span) -> dict[str, str]:
        """The headers that continue ``span`` downstream."""
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        return out

    def start(self, name: str, kind: SpanKind, parent: otel_context.Context | trace.Span,
              attributes: Mapping[str, Any] | None = None,
              start_ns: int | None = None) -> trace.Span:
        ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        return self.tracer.start_span(name, context=ctx, kind=kind, attributes=attributes,
                                      start_time=start_ns)

    def shutdown(self) -> None:
        """Export what is buffered and stop (the process is ending)."""
        self.provider.shutdown()


def _set(span: trace.Span, attrs: Mapping[str, Any]) -> None:
    span.set_attributes({k: v for k, v in attrs.items() if v is not None})


class RequestTrace:
    """A replica's span for one generation request; ``finish`` adds the engine's timings as
    child spans and ends it."""

    def __init__(self, tracing: Tracing, headers: Mapping[str, str], operation: str,
                 model: str, role: str, request: Any) -> None:
        self.tracing = tracing
        leg = getattr(request, "kv_transfer", None)
        # a decode leg's prefill span (its traceparent came back with the handle)
        self.prefill_parent = getattr(leg, "traceparent", None) if leg is not None else None
        parent = tracing.context(headers, self.prefill_parent)
        self.span = tracing.start(f"{operation} {model}", SpanKind.SERVER, parent)
        _set(self.span, {
            "gen_ai.operation.name": operation, "gen_ai.provider.name": "kvserve",
            "gen_ai.request.model": getattr(request, "model", None) or model,
            "gen_ai.response.model": model,
            "gen_ai.request.max_tokens": (getattr(request, "max_completion_tokens", None)
                                          or getattr(request, "max_tokens", None)),
            "gen_ai.request.temperature": getattr(request, "temperature", None),
            "gen_ai.request.top_p": getattr(request, "top_p", None),
            "gen_ai.request.seed": getattr(request, "seed", None),
            "gen_ai.request.choice.count": getattr(request, "n", 1),
            "kvserve.role": role,
            "kvserve.leg": leg.role if leg is not None else None,
            "kvserve.stream": bool(getattr(request, "stream", False)),
        })
        self._ended = False

    def traceparent(self) -> str:
        return self.tracing.traceparent(self.span)["traceparent"]

    def fail(self, error: BaseException) -> None:
        """The request ended before it was generated (a 4xx / 5xx)."""
        if self._ended:
            return
        status = getattr(error, "status", None)
        _set(self.span, {"http.response.status_code": status,
                         "error.type": type(error).__name__})
        self.span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        self.span.end()
        self._ended = True

    def finish(self, request_id: str, arrival: float, metrics: list[RequestMetrics | None],
               input_tokens: int, output_tokens: int, finish_reasons: list[str]) -> None:
        """End the span with the request's outcome; one child span per engine phase of each
        prompt (``metrics``: each prompt's, from its last output)."""
        if self._ended:
            return
        self._ended = True
        span, off = self.span, _offset_ns()
        attrs: dict[str, Any] = {
            "gen_ai.response.id": request_id,
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": finish_reasons,
            "gen_ai.server.request.duration": time.monotonic() - arrival,
            "gen_ai.latency.e2e": time.monotonic() - arrival,
        }
        m0 = metrics[0] if metrics else None
        if m0 is not None:
            attrs.update(_request_attrs(m0, arrival))
        attrs.update(_spec_attrs(metrics))
        cached = sum(m.num_cached_tokens for m in metrics if m is not None)
        attrs["gen_ai.usage.cache_read.input_tokens"] = cached
        attrs["kvserve.cached_tokens"] = cached
        _set(span, attrs)
        for i, m in enumerate(metrics):
            if m is not None:
                self._phases(m, i if len(metrics) > 1 else None, off)
        if any(r in ("abort", "timeout") for r in finish_reasons):
            span.set_status(Status(StatusCode.ERROR, ",".join(finish_reasons)))
        span.end()

    def _phases(self, m: RequestMetrics, prompt: int | None, off: int) -> None:
        tr, parent = self.tracing, self.span
        base = {} if prompt is None else {"kvserve.prompt_index": prompt}

        def child(name: str, t0: float | None, t1: float | None, attrs: dict,
                  links: list[Link] | None = None) -> None:
            if t0 is None or t1 is None:
                return
            s = tr.tracer.start_span(name, context=trace.set_span_in_context(parent),
                                     kind=SpanKind.INTERNAL, start_time=_ns(t0, off),
                                     links=links)
            _set(s, {**base, **attrs})
            s.end(end_time=_ns(max(t0, t1), off))

        child("kvserve.queue", m.arrival_time, m.first_scheduled_time,
              {"kvserve.queue_time": _dt(m.arrival_time, m.first_scheduled_time)})
        if m.kv_import is not None:
            links = None
            if self.prefill_parent:
                ctx = trace.get_current_span(tr.context({}, self.prefill_parent))
                links = [Link(ctx.get_span_context())]
            child("kvserve.kv_transfer.import", m.kv_import.start,
                  m.kv_import.start + m.kv_import.seconds, _move_attrs(m.kv_import), links)
        for mv in m.kv_restores or ():
            child("kvserve.kv_tier.restore", mv.start, mv.start + mv.seconds,
                  {**_move_attrs(mv, "kvserve.kv_tier"),
                   **{f"kvserve.kv_tier.blocks_restored.{t}": n for t, n in mv.by_tier}})
        decode_from = m.first_token_time
        handed = (m.first_token_time is not None and m.first_scheduled_time is not None
                  and m.first_token_time <= m.first_scheduled_time)
        if handed:  # a decode leg: its first token came with the KV, no prefill ran here
            decode_from = m.first_scheduled_time
        else:
            child("kvserve.prefill", m.first_scheduled_time, m.first_token_time,
                  {"kvserve.cached_tokens": m.num_cached_tokens})
        if m.kv_export is not None:
            child("kvserve.kv_transfer.export", m.kv_export.start,
                  m.kv_export.start + m.kv_export.seconds, _move_attrs(m.kv_export))
        if m.finished_time is not None and m.last_token_time != m.first_token_time:
            child("kvserve.decode", decode_from, m.finished_time, _spec_attrs([m]))


def _dt(t0: float | None, t1: float | None) -> float | None:
    return None if t0 is None or t1 is None else max(0.0, t1 - t0)


def _request_attrs(m: RequestMetrics, arrival: float) -> dict[str, Any]:
    """The server span's timing attributes (seconds), gen_ai's and vLLM's names."""
    ttft = _dt(arrival, m.first_token_time)
    queue = _dt(m.arrival_time, m.first_scheduled_time)
    out: dict[str, Any] = {
        "gen_ai.server.time_to_first_token": ttft,
        "gen_ai.latency.time_to_first_token": ttft,
        "gen_ai.latency.time_in_queue": queue,
        "kvserve.queue_time": queue,
        "gen_ai.latency.time_in_model_prefill": _dt(m.first_scheduled_time, m.first_token_time),
        "gen_ai.latency.time_in_model_decode": _dt(m.first_token_time, m.finished_time),
        "kvserve.preemptions": m.num_preemptions or None,
        "kvserve.integrity_repairs": m.integrity_repairs,
    }
    if m.kv_import is not None:
        out.update(_move_attrs(m.kv_import, "kvserve.kv_transfer.import"))
    if m.kv_export is not None:
        out.update(_move_attrs(m.kv_export, "kvserve.kv_transfer.export"))
    if m.kv_restores:
        tiers: dict[str, int] = {}
        for mv in m.kv_restores:
            for t, n in mv.by_tier:
                tiers[t] = tiers.get(t, 0) + n
        out.update({f"kvserve.kv_tier.blocks_restored.{t}": n for t, n in tiers.items()})
        out["kvserve.kv_tier.restore_seconds"] = sum(mv.seconds for mv in m.kv_restores)
    return out


def _spec_attrs(metrics: list[RequestMetrics | None]) -> dict[str, Any]:
    """Speculative decoding's acceptance over the request's sequences (none when the engine
    does not speculate): verify steps with drafts, draft tokens, accepted ones, their ratio and
    the mean accepted length (1 + accepted / drafts, as ``kvserve bench spec`` reports it)."""
    uses = [m.spec_decode for m in metrics if m is not None and m.spec_decode is not None]
    if not uses:
        return {}
    drafts = sum(u.num_drafts for u in uses)
    drafted = sum(u.num_draft_tokens for u in uses)
    accepted = sum(u.num_accepted_tokens for u in uses)
    p = "kvserve.spec_decode."
    return {f"{p}num_drafts": drafts, f"{p}num_draft_tokens": drafted,
            f"{p}num_accepted_tokens": accepted,
            f"{p}acceptance_rate": accepted / drafted if drafted else None,
            f"{p}mean_accepted_length": 1.0 + accepted / drafts if drafts else None}


def _move_attrs(mv: KVMove, prefix: str = "kvserve.kv_transfer") -> dict[str, Any]:
    return {f"{prefix}.seconds": mv.seconds, f"{prefix}.bytes": mv.nbytes or None,
            f"{prefix}.blocks": mv.blocks, f"{prefix}.rejected_blocks": mv.rejected or None,
            f"{prefix}.fallback": mv.fallback}


class RouterTrace:
    """The router's SERVER span for one request and a CLIENT span per forward to a replica
    (prefill leg, decode leg, or the whole request; retries each their own)."""

    def __init__(self, tracing: Tracing, headers: Mapping[str, str], path: str) -> None:
        self.tracing = tracing
        self.span = tracing.start(f"POST {path}", SpanKind.SERVER, tracing.context(headers),
                                  {"http.request.method": "POST", "url.path": path,
                                   "kvserve.component": "router"})
        self._open: list[trace.Span] = []
        self._ended = False

    def forward(self, leg: str, replica: str, url: str, path: str) -> tuple[trace.Span,
                                                                            dict[str, str]]:
        """A CLIENT span for one forward, and the headers that carry it."""
        host = urlsplit(url)
        span = self.tracing.start(f"POST {path}", SpanKind.CLIENT, self.span, {
            "http.request.method": "POST", "server.address": host.hostname,
            "server.port": host.port, "url.full": f"{url}{path}", "kvserve.leg": leg,
            "kvserve.replica": replica})
        self._open.append(span)
        return span, self.tracing.traceparent(span)

    def forwarded(self, span: trace.Span, status: int | None, error: str | None = None) -> None:
        if span not in self._open:
            return
        self._open.remove(span)
        _set(span, {"http.response.status_code": status, "error.type": error})
        if error is not None or (status is not None and status >= 500):
            span.set_status(Status(StatusCode.ERROR, error or str(status)))
        span.end()

    def set(self, attrs: Mapping[str, Any]) -> None:
        _set(self.span, attrs)

    def end(self, status: int | None, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        for span in list(self._open):  # a relayed stream's forward ends with it
            self.forwarded(span, status, error)
        _set(self.span, {"http.response.status_code": status, "error.type": error})
        if error is not None or (status is not None and status >= 500):
            self.span.set_status(Status(StatusCode.ERROR, error or str(status)))
        self.span.end()
