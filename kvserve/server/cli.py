"""``kvserve serve [MODEL]``: run the OpenAI-compatible server with uvicorn.

Shutdown: the first SIGTERM (or SIGINT) starts draining: ``/ready`` turns 503 and new
generation requests get 503 while in-flight ones finish; once none is left uvicorn closes the
listener and the process exits 0. When ``--drain-timeout`` passes first, or on a second
signal, the requests still in flight are ended (streams with ``finish_reason: "abort"`` and
``[DONE]``) and the server exits 0 within about 2 s more. A third signal exits at once.
If the engine dies (e.g. a tensor-parallel worker rank exits or hangs), the server fails the
requests in flight, shuts down and exits 1 with a log line saying why.

Only argparse is imported at module level: ``kvserve.cli`` imports this module on every run.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

logger = logging.getLogger("kvserve.server")


def register(subparsers, add_engine_args: Callable, engine_args_from: Callable) -> None:
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve MODEL with an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /ready, /metrics).")
    add_engine_args(p, model_positional=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the model folder's name)")
    g.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: "
                        "$KVSERVE_API_KEY; unset: no authentication)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="sequences (prompts x n) that may be admitted beyond --max-num-seqs; "
                        "more get 429")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per request before it is cut (0: no limit)")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                   help="largest request body in bytes; larger get 413")
    g.add_argument("--max-n", type=int, default=16, help="largest n per request")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds to let in-flight requests finish on SIGTERM before ending "
                        "them (streams get finish_reason 'abort' and [DONE]); exit follows "
                        "within about 2 s")
    g.add_argument("--tokenizer-workers", type=int, default=2,
                   help="threads that tokenize prompts and render chat templates off the "
                        "event loop")
    g.add_argument("--no-access-log", action="store_true",
                   help="do not log a line per HTTP request (logger kvserve.access)")
    g.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to sleep after each engine step (testing: a slower model)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level")
    p.set_defaults(func=lambda ns: serve(ns, engine_args_from(ns)))


def _served_name(ns: argparse.Namespace, model: str | None) -> str:
    if ns.served_model_name:
        return ns.served_model_name
    if model is None:
        from kvserve.model.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    if model == "demo":
        return "kvserve-demo"
    name = os.path.basename(os.path.normpath(model))
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name or "kvserve"


def serve(ns: argparse.Namespace, engine_args) -> int:
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.server.api import build_app
    from kvserve.server.launch import DrainingServer
    from kvserve.server.settings import ServerSettings

    settings = ServerSettings(
        served_model_name=_served_name(ns, engine_args.model),
        api_key=ns.api_key or None,
        max_queue=ns.max_queue,
        request_timeout=ns.request_timeout if ns.request_timeout > 0 else None,
        max_body_bytes=ns.max_body_bytes,
        max_n=ns.max_n,
        tokenizer_workers=ns.tokenizer_workers,
        access_log=not ns.no_access_log,
    )
    if ns.drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0, got {ns.drain_timeout}")
    engine = AsyncLLMEngine.from_engine_args(engine_args, step_delay_s=ns.step_delay)
    app = None
    try:
        app = build_app(engine, settings)
        engine.start()
        server = DrainingServer.create(app, ns.host, ns.port, ns.drain_timeout,
                                       ns.uvicorn_log_level)
        logger.info("serving %s on http://%s:%d", settings.served_model_name, ns.host, ns.port)
        server.run()
    finally:
        engine.shutdown()
        if app is not None:
            app.state.server.close()
    if server.engine_error is not None:
        logger.error("kvserve serve: exiting with status 1: the engine died: %s",
                     server.engine_error)
        return 1
    return 0
