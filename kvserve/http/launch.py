"""``DrainingServer``: uvicorn with a graceful drain on SIGTERM / SIGINT.

Plain uvicorn closes its listening socket on the first signal, so a load balancer could never
see ``/ready`` turn 503. Here the first signal only flags the app as draining (``/ready`` 503,
new generation requests 503); uvicorn's 0.1 s tick then waits until no generation request is
in flight before starting its normal shutdown. When the drain timeout passes first, or on a
second signal, every request still in flight is ended on purpose (``ServerState.end_all``):
streams get a final chunk with ``finish_reason: "abort"`` and ``data: [DONE]``, so no client
sees a cut chunked body and no task is cancelled mid-write; the server then waits up to
``FORCE_GRACE_S`` for those answers to be written before shutting down, and uvicorn's own
grace period (``UVICORN_GRACE_S``, for connections still open after that) follows. A forced
shutdown therefore takes at most ``--drain-timeout`` + 2 s. The signal is not re-raised
afterwards, so the process exits 0. A third signal exits at once.

When the engine dies (its thread raised: a tensor-parallel rank exited or hung past the
collective timeout, or any other engine failure) the server stops on its own: ``/health`` and
``/ready`` answer 503 and every request in flight has already been failed by the engine (an
error response or a stream's error event, never a hang); after ``FORCE_GRACE_S`` for those
answers to be written it shuts down, and ``kvserve serve`` logs why and exits 1
(``engine_error``), so a supervisor (systemd, Kubernetes) sees the failure and restarts it.

``listen_socket`` binds the port before anything slow or port-hungry runs (loading the model,
tensor-parallel ranks' gloo sockets, replica processes): a port in use fails at once with a
clear error, and nothing started later can take it (``--port 0``: the system picks one).
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from types import FrameType
from typing import Protocol

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger("kvserve.server")


class Drainable(Protocol):
    """What the drain drives: ``ServerState`` (one engine) or the replica router's state."""

    draining: bool

    @property
    def inflight(self) -> int: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    def end_all(self) -> None: ...
def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (``host``, ``port``) for ``DrainingServer.run(sockets=[...])``;
    ``ValueError`` naming the port when it is taken."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e}") from e
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds at once
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        # listening now, not when uvicorn starts: only a listening socket keeps every other
        # bind off the port (two SO_REUSEADDR sockets may share a port neither listens on);
        # a client that connects meanwhile waits in the backlog until the app serves
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"port: cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


FORCE_GRACE_S = 1.0
UVICORN_GRACE_S = 1


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Drainable, drain_timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout = drain_timeout
        self._drain_started: float | None = None
        self._force_requested = False
        self._forced_at: float | None = None
        self._engine_dead_at: float | None = None
        self.engine_error: BaseException | None = None  # why the engine died, if it did

    @classmethod
    def create(cls, app: FastAPI, host: str, port: int, drain_timeout: float,
               log_level: str = "warning", lifespan: str = "off") -> DrainingServer:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                lifespan=lifespan, timeout_graceful_shutdown=UVICORN_GRACE_S,
                                access_log=False)
        return cls(config, app.state.server, drain_timeout)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags here; on_tick (on the event loop) acts on them.
        if self._force_requested or self.should_exit:
            self.should_exit = self.force_exit = True  # third signal: stop now
            return
        if self._drain_started is not None:
            logger.warning("second %s: ending %d in-flight request(s) now",
                           signal.Signals(sig).name, self._state.inflight)
            self._force_requested = True
            return
        name = signal.Signals(sig).name
        logger.warning("%s: draining %d in-flight request(s)", name, self._state.inflight)
        self._state.draining = True
        self._drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        dead = self._state.dead_error
        if dead is not None and self._engine_dead_at is None:
            self.engine_error = dead
            self._engine_dead_at = time.monotonic()
            self._state.draining = True
            logger.error("the engine died (%s); shutting down", dead)
        if self._engine_dead_at is not None and not self.should_exit and (
                self._state.inflight <= 0
                or time.monotonic() - self._engine_dead_at >= FORCE_GRACE_S):
            self.should_exit = True  # the engine already failed every request in flight
        if self._drain_started is not None and not self.should_exit:
            now = time.monotonic()
            if self._state.inflight <= 0:
                logger.warning("drained; shutting down" if self._forced_at is None else
                               "in-flight requests ended; shutting down")
                self.should_exit = True
            elif self._forced_at is not None:
                if now - self._forced_at >= FORCE_GRACE_S:
                    logger.warning("%d request(s) still open after ending them; shutting down",
                                   self._state.inflight)
                    self.should_exit = True
            elif self._force_requested or now - self._drain_started >= self._drain_timeout:
                if not self._force_requested:
                    logger.warning("drain timeout: ending %d in-flight request(s)",
                                   self._state.inflight)
                self._state.end_all()
                self._forced_at = now
        return await super().on_tick(counter)
