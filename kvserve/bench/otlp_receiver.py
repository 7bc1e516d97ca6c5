"""A tiny OTLP/HTTP trace receiver on loopback: ``POST /v1/traces`` bodies
(``ExportTraceServiceRequest``, protobuf, decoded with opentelemetry-proto; gzip accepted)
become ``ReceivedSpan`` records. For the tracing tests, the tracing-overhead benchmark and
printing a request's span tree (docs/server.md, "Tracing").

    with OTLPReceiver() as rx:             # rx.endpoint: http://127.0.0.1:PORT/v1/traces
        ...                                 # kvserve serve --otlp-traces-endpoint rx.endpoint
        rx.wait_for(lambda spans: len(spans) >= 5, timeout=30)
        print(tree(rx.trace(trace_id)))

As a process (a collector apart from the load generator: benchmarks/tracing_overhead.py):
``python -m kvserve.bench.otlp_receiver [PORT]`` prints its endpoint, serves until stdin
closes; ``GET /stats`` answers the spans and export requests received so far.
"""

from __future__ import annotations

import gzip
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 64 << 20
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER",
          5: "CONSUMER"}


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    service: str  # the resource's service.name
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    status: int  # 0 unset, 1 ok, 2 error

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest`` (protobuf, never pickle)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    return spans_of(req)


def spans_of(req: Any) -> list[ReceivedSpan]:
    """The spans of a decoded ``ExportTraceServiceRequest``."""
    out = []
    for rs in req.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                    _KINDS.get(s.kind, str(s.kind)), service, s.start_time_unix_nano,
                    s.end_time_unix_nano, _attrs(s.attributes),
                    tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links),
                    s.status.code))
    return out


class OTLPReceiver:
    """``endpoint``: OTLP/HTTP; with ``grpc=True`` also OTLP/gRPC on ``grpc_endpoint``
    (``grpc://127.0.0.1:PORT``, plaintext; needs grpcio)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, grpc: bool = False) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._cond = threading.Condition()
        self._grpc = None
        self.grpc_endpoint: str | None = None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                n = int(self.headers.get("Content-Length") or 0)
                if self.path.rstrip("/") != "/v1/traces" or not 0 < n <= MAX_BODY:
                    self.send_error(404 if n else 400)
                    return
                body = self.rfile.read(n)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                try:
                    spans = decode_spans(body)
                except Exception:  # noqa: BLE001 - a malformed body is the sender's error
                    self.send_error(400)
                    return
                receiver._add(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")  # an empty ExportTraceServiceResponse
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802 - GET /stats: what arrived so far
                if self.path != "/stats":
                    self.send_error(404)
                    return
                with receiver._cond:
                    body = json.dumps({"spans": len(receiver.spans),
                                       "requests": receiver.requests}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://{host}:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="otlp-receiver", daemon=True)
        self._thread.start()
        if grpc:
            self._start_grpc(host)

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self.spans.extend(spans)
            self.requests += 1
            self._cond.notify_all()

    def _start_grpc(self, host: str) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
                receiver._add(spans_of(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        port = self._grpc.add_insecure_port(f"{host}:0")
        self._grpc.start()
        self.grpc_endpoint = f"grpc://{host}:{port}"

    def __enter__(self) -> OTLPReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self.spans)

    def wait_for(self, pred: Callable[[list[ReceivedSpan]], bool],
                 timeout: float) -> list[ReceivedSpan]:
        """The spans once ``pred(spans)`` holds; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.spans)} spans received; condition unmet")
                self._cond.wait(min(left, 0.5))
            return list(self.spans)

    def clear(self) -> None:
        with self._cond:
            self.spans.clear()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]


def tree(spans: list[ReceivedSpan], attrs: tuple[str, ...] = ()) -> str:
    """One trace as an indented tree (children by start time): service, kind, name, duration
    and the attributes named in ``attrs`` that a span has."""
    by_parent: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        by_parent.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda x: x.start_ns):
            shown = [f"{k}={s.attributes[k]}" for k in attrs if k in s.attributes]
            link = f" link->{s.links[0][1][:8]}" if s.links else ""
            lines.append(f"{'  ' * depth}{s.name} [{s.service} {s.kind}] "
                         f"{s.seconds * 1e3:.1f} ms span={s.span_id[:8]}{link}"
                         + (f"  {' '.join(shown)}" if shown else ""))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with OTLPReceiver(port=int(args[0]) if args else 0) as rx:
        print(rx.endpoint, flush=True)
        sys.stdin.read()  # until the parent closes the pipe
    return 0


if __name__ == "__main__":
    sys.exit(main())
