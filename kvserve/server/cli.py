"""``kvserve serve [MODEL]``: run the OpenAI-compatible server with uvicorn.

Shutdown: the first SIGTERM (or SIGINT) starts draining: ``/ready`` turns 503 and new
generation requests get 503 while in-flight ones finish; once none is left (or
``--drain-timeout`` passes) uvicorn closes the listener and the process exits 0. A second
SIGINT/SIGTERM exits at once.

Only argparse is imported at module level: ``kvserve.cli`` imports this module on every run.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

logger = logging.getLogger("kvserve.server")


def register(subparsers, add_engine_args: Callable, engine_args_from: Callable) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the model folder's name)")
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $KVSERVE_API_KEY)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond --max-num-seqs before 429")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per request before it is cut (0: no limit)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    p.add_argument("--max-n", type=int, default=16, help="largest n per request")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds to wait for in-flight requests on SIGTERM")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep after each engine step (testing: simulates a slower model)")
    p.add_argument("--uvicorn-log-level", default="warning")
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
    )
    if ns.drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0, got {ns.drain_timeout}")
    engine = AsyncLLMEngine.from_engine_args(engine_args, step_delay_s=ns.step_delay)
    try:
        app = build_app(engine, settings)
        engine.start()
        server = DrainingServer.create(app, ns.host, ns.port, ns.drain_timeout,
                                       ns.uvicorn_log_level)
        logger.info("serving %s on http://%s:%d", settings.served_model_name, ns.host, ns.port)
        server.run()
    finally:
        engine.shutdown()
    return 0
