"""``kvserve router --replica URL ...``: the OpenAI endpoint in front of replicas that run
elsewhere; and ``run_router``, which ``kvserve serve --data-parallel-size N`` shares.

Only the standard library (and the torch-free settings classes) at module level:
``kvserve.cli`` imports this module on every run.
"""

from __future__ import annotations

import argparse
import logging
import socket

from kvserve.config_cli import add_cli_args, from_cli_args
from kvserve.router.settings import RouterSettings
from kvserve.server.settings import LaunchSettings, ServerSettings

logger = logging.getLogger("kvserve.router")
# serve's flags that mean nothing to a router
_NOT_ROUTER_LAUNCH = ("step_delay", "output_handoff", "data_parallel_size",
                      "replica_threads")
_NOT_ROUTER_SERVER = ("served_model_name", "max_queue", "request_timeout", "max_n")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "router", help="route one OpenAI endpoint over kvserve replicas",
        description="Serve one OpenAI endpoint in front of kvserve replicas (each `kvserve "
                    "serve ... --kv-events-endpoint tcp://*:PORT`), with session-affinity "
                    "and prefix-aware routing (docs/replicas.md).")
    add_cli_args(p, RouterSettings)
    add_cli_args(p, LaunchSettings, skip=_NOT_ROUTER_LAUNCH)
    add_cli_args(p, ServerSettings, skip=_NOT_ROUTER_SERVER)
    p.set_defaults(func=_router_main)


def _router_main(ns: argparse.Namespace) -> int:
    router = from_cli_args(RouterSettings, ns)
    if not router.replicas and not router.decode:
        raise ValueError("replicas: give at least one --replica (or --decode) URL")
    return run_router(router, from_cli_args(LaunchSettings, ns, skip=_NOT_ROUTER_LAUNCH),
                      from_cli_args(ServerSettings, ns, skip=_NOT_ROUTER_SERVER))


def run_router(router: RouterSettings, launch: LaunchSettings, server: ServerSettings,
               sock: socket.socket | None = None) -> int:
    """Serve the router app; ``sock``: its port, already bound (``listen_socket``)."""
    from kvserve.http.launch import DrainingServer, bound_port, listen_socket
    from kvserve.model.default_model import resolve_model
    from kvserve.model.loader import load_tokenizer
    from kvserve.router.app import RouterState, build_router_app

    sock = sock or listen_socket(launch.host, launch.port)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    tokenizer = None
    if router.uses_tokenizer:
        tokenizer = load_tokenizer(resolve_model(router.prefix_tokenizer))
    tracing = None
    if server.otlp_traces_endpoint is not None:
        from kvserve.http.tracing import Tracing

        tracing = Tracing(server.otlp_traces_endpoint, server.otlp_traces_protocol,
                          "kvserve-router")
    state = RouterState(router, server.api_key, tokenizer, server.tokenizer_workers, tracing)
    app = build_router_app(state, api_key=server.api_key,
                           max_body_bytes=server.max_body_bytes, access_log=server.access_log)
    port = bound_port(sock)
    http = DrainingServer.create(app, launch.host, port, launch.drain_timeout,
                                 launch.uvicorn_log_level, lifespan="on")
    logger.info("routing (%s) on http://%s:%d over %d replica(s)", router.routing, launch.host,
                port, len(router.replicas))
    try:
        http.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def serve_replicas(ns: argparse.Namespace, engine_args, server: ServerSettings,
                   launch: LaunchSettings, argv: list[str]) -> int:
    """``kvserve serve --data-parallel-size N``: the replica processes, then the router."""
    from kvserve.http.launch import listen_socket
    from kvserve.router.launch import ReplicaProcesses

    sock = listen_socket(launch.host, launch.port)  # before any replica can take the port
    procs = ReplicaProcesses(argv, launch.data_parallel_size, threads=launch.replica_threads,
                             device=engine_args.device,
                             tensor_parallel_size=engine_args.tensor_parallel_size,
                             prefill=launch.prefill_replicas)
    p = launch.prefill_replicas
    router = from_cli_args(RouterSettings, ns, skip=RouterSettings.REPLICA_FIELDS,
                           replicas=tuple(procs.urls[p:]), prefill=tuple(procs.urls[:p]),
                           replica_api_key=procs.key,
                           tokenizer=engine_args.tokenizer or engine_args.model)
    try:
        procs.start()
        return run_router(router, launch, server, sock)
    finally:
        sock.close()
        procs.stop()
