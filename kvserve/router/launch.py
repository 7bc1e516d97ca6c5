"""``kvserve serve --data-parallel-size N``: N replica processes behind the router.

Each replica is ``kvserve serve`` with the same arguments, on a loopback port reserved here,
with its own CPU threads (``OMP_NUM_THREADS``: ``--replica-threads``, default the cores split
evenly), its own devices on CUDA (``CUDA_VISIBLE_DEVICES``: ``-tp`` consecutive ones each), its
own tensor-parallel group, a KV-event publisher on a loopback port, and a random key only the
router knows (in its environment, not its command line). The router serves the OpenAI endpoint
on ``--host`` / ``--port`` with the client-facing ``--api-key``.

A replica process that exits is started again on the same port (at most ``MAX_RESTARTS``
times each); the router's health checks take it out of the pool meanwhile and let it rejoin.
The replicas stop when this process is gone (``watch_parent``); on shutdown (after the router's
drain) each gets SIGTERM, then SIGKILL after ``STOP_GRACE_S``.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

logger = logging.getLogger("kvserve.router")
MAX_RESTARTS = 5
STOP_GRACE_S = 10.0
# Options of `serve` a replica must not inherit (the router owns them), with their arity.
_STRIPPED = {"--data-parallel-size": 1, "-dp": 1, "--port": 1, "--host": 1, "--api-key": 1,
             "--replica-threads": 1, "--kv-events-endpoint": 1,
             "--kv-events-replay-endpoint": 1, "--replica": 1, "--prefill-replicas": 1,
             "--role": 1}


class PortReservation:
    """A free loopback port held for a child server: a bound, non-listening SO_REUSEADDR
    socket, open until ``close``. While it is open the kernel's port-0 binds (another
    process's gloo or ZMQ socket) never take the port, yet the child's own SO_REUSEADDR bind
    and listen (``kvserve serve``'s ``listen_socket``, uvicorn) succeed; with nobody listening,
    connections are refused (the router's health checks see a dead replica, and a restarted
    replica binds the same port again). A port read from a socket that was closed at once
    could be taken by anyone before the child binds it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()


def replica_argv(argv: list[str]) -> list[str]:
    """``argv`` (the serve command line after ``serve``) without the router-owned options."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _STRIPPED:
            if "=" not in a:
                skip = _STRIPPED[name]
            continue
        out.append(a)
    return out


PARENT_ENV = "KVSERVE_REPLICA_PARENT"


def watch_parent() -> None:
    """In a replica: SIGTERM itself (a normal drain) once the process that started it is gone,
    so replicas never outlive a router that was killed. No-op outside ``-dp`` replicas."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


class ReplicaProcesses:
    def __init__(self, argv: list[str], n: int, *, threads: int | None, device: str,
                 tensor_parallel_size: int, prefill: int = 0) -> None:
        if n < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {n}")
        if not 0 <= prefill < n:
            raise ValueError(f"prefill_replicas must be in [0, data_parallel_size), got "
                             f"{prefill}")
        # Disaggregation (docs/disaggregation.md): replicas 0..prefill-1 run prompts, the rest
        # decode; the KV moves through a shared directory (tmpfs where there is one) unless
        # the command line chose a transfer.
        self.prefill = prefill
        self.transfer_dir: str | None = None
        if prefill and "--kv-transfer" not in argv:
            import tempfile

            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.transfer_dir = tempfile.mkdtemp(prefix="kvserve-kv-transfer-", dir=shm)
        if threads is not None and threads < 1:
            raise ValueError(f"replica_threads must be >= 1, got {threads}")
        self.key = secrets.token_urlsafe(24)
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        self._ports = [PortReservation() for _ in range(n)]  # held until stop()
        self.ports = [r.port for r in self._ports]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self._argv = replica_argv(argv)
        self._device, self._tp = device, tensor_parallel_size
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.restarts = [0] * n
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="kvserve-replicas",
                                         daemon=True)

    def _spawn(self, i: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", *self._argv,
               "--host", "127.0.0.1", "--port", str(self.ports[i]),
               "--kv-events-endpoint", "tcp://127.0.0.1:0",
               "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]
        if self.prefill:
            cmd += ["--role", "prefill" if i < self.prefill else "decode"]
            if self.transfer_dir is not None:
                cmd += ["--kv-transfer", "dir", "--kv-transfer-dir", self.transfer_dir]
        env = dict(os.environ, KVSERVE_API_KEY=self.key, OMP_NUM_THREADS=str(self.threads),
                   **{PARENT_ENV: str(os.getpid())})
        if self._device.startswith("cuda"):
            first = i * self._tp
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(first,
                                                                         first + self._tp))
        logger.info("starting replica r%d on %s (%d thread(s))", i, self.urls[i], self.threads)
        return subprocess.Popen(cmd, env=env)

    def start(self) -> ReplicaProcesses:
        for i in range(len(self.procs)):
            self.procs[i] = self._spawn(i)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(1.0):
            with self._lock:
                for i, p in enumerate(self.procs):
                    if p is None or p.poll() is None or self._stopping.is_set():
                        continue
                    if self.restarts[i] >= MAX_RESTARTS:
                        continue
                    self.restarts[i] += 1
                    logger.warning("replica r%d exited with %s; restarting it (%d of %d)", i,
                                   p.returncode, self.restarts[i], MAX_RESTARTS)
                    self.procs[i] = self._spawn(i)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            procs = [p for p in self.procs if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for r in self._ports:
            r.close()
        if self.transfer_dir is not None:
            import shutil

            shutil.rmtree(self.transfer_dir, ignore_errors=True)
