"""``kvserve serve [MODEL]``: run the OpenAI-compatible server with uvicorn; with
``--data-parallel-size N``, N replica processes and the router in front of them
(``kvserve.router_cli``). It sits above both ``kvserve.server`` and ``kvserve.router``.

Shutdown: the first SIGTERM (or SIGINT) starts draining: ``/ready`` turns 503 and new
generation requests get 503 while in-flight ones finish; once none is left uvicorn closes the
listener and the process exits 0. When ``--drain-timeout`` passes first, or on a second
signal, the requests still in flight are ended (streams with ``finish_reason: "abort"`` and
``[DONE]``) and the server exits 0 within about 2 s more. A third signal exits at once.
If the engine dies (e.g. a tensor-parallel worker rank exits or hangs), the server fails the
requests in flight, shuts down and exits 1 with a log line saying why.

Only the standard library is imported at module level (the settings classes and
``EngineArgs`` are torch-free): ``kvserve.cli`` imports this module on every run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvserve.config_cli import add_cli_args, from_cli_args
from kvserve.engine.arg_utils import EngineArgs
from kvserve.router.settings import RouterSettings
from kvserve.server.settings import LaunchSettings, ServerSettings

logger = logging.getLogger("kvserve.server")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve MODEL with an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /ready, /metrics).")
    EngineArgs.add_cli_args(p, model_positional=True)
    add_cli_args(p, LaunchSettings)
    add_cli_args(p, ServerSettings)
    add_cli_args(p, RouterSettings, skip=RouterSettings.REPLICA_FIELDS)  # with -dp N
    p.set_defaults(func=_serve)


# libgomp's OpenMP workers spin after each parallel region before they sleep: by default up to
# 300,000 pause loops, 1-17 ms depending on the core. After a step's forward that holds a core
# through the engine's Python, the event loop's chunk writing and the client's reading, which
# on a small CPU then wait for it; the gaps between the kernels of one forward are
# microseconds. 10,000 loops (~0.05-0.5 ms) still cover those (docs/server.md "Served vs
# offline").
SERVE_GOMP_SPINCOUNT = "10000"


def quiet_openmp_spin(environ: dict[str, str] | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to ``SERVE_GOMP_SPINCOUNT`` in ``environ`` (default: this
    process's, unless torch, and with it libgomp, which reads it once, is already loaded)
    unless it already says how OpenMP threads wait (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``).
    True if it was set."""
    if environ is None:
        if "torch" in sys.modules:
            return False
        environ = os.environ  # type: ignore[assignment]
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SERVE_GOMP_SPINCOUNT
    return True


def _serve(ns: argparse.Namespace) -> int:
    quiet_openmp_spin()  # before EngineArgs, which loads torch
    return serve(ns, EngineArgs.from_cli_args(ns))


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


def serve(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.http.launch import DrainingServer
    from kvserve.server.api import build_app

    settings = from_cli_args(ServerSettings, ns,
                             served_model_name=_served_name(ns, engine_args.model))
    launch = from_cli_args(LaunchSettings, ns)
    if launch.data_parallel_size > 1:
        from kvserve.router_cli import serve_replicas

        argv = list(getattr(ns, "argv", None) or sys.argv[1:])
        if "serve" in argv:
            argv = argv[argv.index("serve") + 1:]
        return serve_replicas(ns, engine_args, settings, launch, argv)
    from kvserve.http.launch import bound_port, listen_socket
    from kvserve.router.launch import watch_parent

    watch_parent()  # a replica of `serve --data-parallel-size` ends with its router
    # The engine thread and the event loop share the GIL: a short interval bounds the engine's
    # wait for it (kvserve/engine/async_engine.py; docs/server.md "Served vs offline").
    sys.setswitchinterval(launch.switch_interval_ms / 1000)
    sock = listen_socket(launch.host, launch.port)  # before the model loads (see launch.py)
    app = engine = None
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args, step_delay_s=launch.step_delay,
                                                  output_handoff=launch.output_handoff)
        app = build_app(engine, settings)
        engine.start()
        server = DrainingServer.create(app, launch.host, bound_port(sock), launch.drain_timeout,
                                       launch.uvicorn_log_level)
        logger.info("serving %s on http://%s:%d", settings.served_model_name, launch.host,
                    bound_port(sock))
        server.run(sockets=[sock])
    finally:
        sock.close()
        if engine is not None:
            engine.shutdown()
        if app is not None:
            app.state.server.close()
    if server.engine_error is not None:
        logger.error("kvserve serve: exiting with status 1: the engine died: %s",
                     server.engine_error)
        return 1
    return 0
