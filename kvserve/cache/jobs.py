"""The request-keyed background jobs of the cache's worker threads (tier restores in
``kv_tiers.py``, disaggregated imports in ``kv_transfer.py``). Each job sets its ``done`` event
once it finished, whatever its outcome; the step loop polls or waits on it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Job(Protocol):
    done: threading.Event


J = TypeVar("J", bound=Job)


class JobBoard(Generic[J]):
    """Jobs by request id and the queue that feeds them, in order, to worker threads. The step
    loop alone submits, looks up and drops jobs; the workers only take them from the queue."""

    def __init__(self) -> None:
        self._jobs: dict[str, J] = {}
        self._queue: queue.Queue[J | None] = queue.Queue()

    def submit(self, req_id: str, job: J) -> None:
        assert req_id not in self._jobs
        self._jobs[req_id] = job
        self._queue.put(job)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._jobs

    def get(self, req_id: str) -> J | None:
        return self._jobs.get(req_id)

    def finished(self, req_id: str) -> J | None:
        """The request's job once it finished (it stays until ``cancel``), else None."""
        job = self._jobs.get(req_id)
        return job if job is not None and job.done.is_set() else None

    def cancel(self, req_id: str) -> None:
        """Forget a request's job (a worker still running it finishes it unseen)."""
        self._jobs.pop(req_id, None)

    def wait_any(self, timeout: float) -> None:
        """Sleep until some job finished (or ``timeout``): an idle step loop whose only work
        waits for jobs does not spin."""
        for job in list(self._jobs.values()):
            if not job.done.is_set():
                job.done.wait(timeout)
                return

    def serve(self, run: Callable[[J], None]) -> None:
        """A worker thread's loop: ``run`` each queued job until ``stop``. ``run`` must not
        raise and must set the job's ``done``."""
        while True:
            job = self._queue.get()
            if job is None:
                return
            run(job)

    def stop(self, workers: int = 1) -> None:
        """End ``workers`` ``serve`` loops once they took the jobs queued before."""
        for _ in range(workers):
            self._queue.put(None)
