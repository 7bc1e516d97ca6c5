"""``DrainingServer``: uvicorn with a graceful drain on SIGTERM / SIGINT.

Plain uvicorn closes its listening socket on the first signal, so a load balancer could never
see ``/ready`` turn 503. Here the first signal only flags the app as draining (``/ready`` 503,
new generation requests 503); uvicorn's 0.1 s tick then waits until no generation request is
in flight (or the drain timeout passes) before starting its normal shutdown. The signal is not
re-raised afterwards, so the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout = drain_timeout
        self._drain_started: float | None = None

    @classmethod
    def create(cls, app: FastAPI, host: str, port: int, drain_timeout: float,
               log_level: str = "warning") -> DrainingServer:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                lifespan="off", timeout_graceful_shutdown=5,
                                access_log=False)
        return cls(config, app.state.server, drain_timeout)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_started is not None or self.should_exit:
            self.should_exit = self.force_exit = True  # second signal: stop now
            return
        name = signal.Signals(sig).name
        logger.warning("%s: draining %d in-flight request(s)", name, self._state.inflight)
        self._state.draining = True
        self._drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self._drain_started is not None and not self.should_exit:
            waited = time.monotonic() - self._drain_started
            if self._state.inflight <= 0:
                logger.warning("drained; shutting down")
                self.should_exit = True
            elif waited >= self._drain_timeout:
                logger.warning("drain timeout: %d request(s) still in flight",
                               self._state.inflight)
                self.should_exit = True
        return await super().on_tick(counter)
