"""What the benchmarks of a served deployment share (``benchmarks/router.py``,
``benchmarks/pd_disagg.py``): one ``kvserve serve`` process on a free port behind an API key,
its output in a temporary log file, waited for, scraped and stopped; their percentile; and
their results file.

Each run starts fresh servers (cold caches), so a run's figures never depend on the one before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from kvserve.router.launch import PortReservation


def percentile(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile, p in [0, 1]; NaN when there are no values."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class LoggedProcess:
    """A server process (``cmd``) with its stdout and stderr in a temporary log that ``stop``
    removes; ``env`` is added to this process's environment."""

    def __init__(self, cmd: list[str], *, log_prefix: str,
                 env: dict[str, str] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives with the process
            "w+", prefix=log_prefix, suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> None:
        """Poll ``ready`` (an HTTP error or a malformed answer counts as not yet) every 0.5 s;
        RuntimeError with the log's tail if the server exits, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                self.log.seek(0)
                raise RuntimeError(f"server exited:\n{self.log.read()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if ready():
                    return
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout} s")

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL after 60 s; the log is removed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


class ServeProcess(LoggedProcess):
    """``kvserve serve [MODEL] --port P --api-key KEY --no-access-log ARGS...`` (MODEL left out
    when None: the default model) on a free port."""

    def __init__(self, model: str | None, args: list[str], *, key: str, log_prefix: str,
                 env: dict[str, str] | None = None) -> None:
        self._port = PortReservation()  # held while the server runs (closed by stop)
        self.port = self._port.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        super().__init__([sys.executable, "-m", "kvserve.cli", "serve",
                          *([model] if model else []), "--port", str(self.port),
                          f"--api-key={key}", "--no-access-log", *args],
                         log_prefix=log_prefix, env=env)

    def stop(self) -> None:
        super().stop()
        self._port.close()

    def router_replicas(self) -> dict:
        """The router's ``GET /router/replicas``."""
        return httpx.get(f"{self.url}/router/replicas", timeout=5,
                         headers={"Authorization": f"Bearer {self.key}"}).json()


def scrape(url: str) -> dict[str, float]:
    """A server's ``/metrics`` as {sample name + its labels as sorted JSON: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))
            out[key] = s.value
    return out


async def sse_chunks(r: httpx.Response) -> AsyncIterator[dict]:
    """The JSON chunks of a server-sent-event stream (``[DONE]`` and other lines passed over);
    RuntimeError on an error event."""
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        yield chunk


def save_panels(results: list[dict], path: str,
                draw: Callable[[list[str], Any], None]) -> None:
    """Three plot panels side by side, the runs' labels on their x axes: ``draw(labels,
    axes)`` fills them; saved to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    draw(labels, axes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(benchmark: str, ns: argparse.Namespace, results: list[dict],
                  plot: Callable[[list[dict], str], None]) -> None:
    """The results as JSON with the machine (``env``) and the options to ``ns.out``, and
    ``plot`` to ``ns.plot``; each only where asked for."""
    from kvserve.bench.common import env_info

    doc = {"benchmark": benchmark, "env": env_info(), "config": vars(ns), "results": results}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1)
    if ns.plot:
        plot(results, ns.plot)


def parser(doc: str) -> argparse.ArgumentParser:
    """A served benchmark's options start with the model (described by the module's first
    paragraph)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default=None, help="served model (default: SmolLM2 GGUF)")
    return p


def add_replica_options(p: argparse.ArgumentParser, kv_cache_memory: str) -> None:
    p.add_argument("--threads", type=int, default=1, help="threads per replica")
    p.add_argument("--max-num-seqs", type=int, default=8, help="per replica")
    p.add_argument("--kv-cache-memory", default=kv_cache_memory, help="KV budget per replica")


def add_output_options(p: argparse.ArgumentParser) -> None:
    """``--startup-timeout`` and where ``write_results`` writes (``--out``, ``--plot``)."""
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--plot", default=None, help="PNG plot file")
