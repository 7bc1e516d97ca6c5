"""Spawned-process harness for tensor-parallel tests (CPU, gloo, world size 2).

``run_world(fn, world, tmp)`` runs ``fn(rank, world, *args)`` in ``world`` spawned processes
joined into one gloo group through a ``file://`` rendezvous in ``tmp``; ``run_driver(fn)``
runs ``fn(*args)`` in one spawned process (which builds a ``tensor_parallel_size=2`` engine
and so spawns its own worker rank). Both join with a timeout, require exit code 0 and return
what ``fn`` returned (through a multiprocessing queue: test plumbing between a parent and
its children, not the engine's channel). One thread per rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback

TIMEOUT_S = 240


def _plain(x):
    """Tensors -> numpy (pickled by value: torch's queue pickling shares memory that dies with
    the child)."""
    import torch

    if isinstance(x, torch.Tensor):
        return ("__tensor__", x.detach().cpu().float().numpy() if x.dtype == torch.bfloat16
                else x.detach().cpu().numpy())
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _torch(x):
    import torch

    if isinstance(x, tuple) and len(x) == 2 and x[0] == "__tensor__":
        return torch.from_numpy(x[1])
    if isinstance(x, dict):
        return {k: _torch(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_torch(v) for v in x)
    return x


def _setup() -> None:
    import torch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)


def _rank_entry(fn, rank: int, world: int, init: str, q, args, collective_timeout_s) -> None:
    _setup()
    from kvserve.distributed import parallel_state as ps

    try:
        ps.init_distributed(init, rank, world, timeout_s=collective_timeout_s)
        q.put((rank, "ok", _plain(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        ps.destroy_distributed()


def _driver_entry(fn, q, args) -> None:
    _setup()
    try:
        q.put((0, "ok", _plain(fn(*args))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((0, "error", traceback.format_exc()))
        raise


def _collect(procs, q, n: int, timeout: float) -> list:
    results: dict[int, object] = {}
    errors = []
    for _ in range(n):
        try:
            rank, status, value = q.get(timeout=timeout)
        except queue.Empty:
            break
        if status == "ok":
            results[rank] = _torch(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=30)
        if p.exitcode is None:
            p.kill()
            p.join(5)
    assert not errors, "\n".join(errors)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"exit codes {codes} (timeout {timeout} s?)"
    assert len(results) == n, f"only ranks {sorted(results)} reported within {timeout} s"
    return [results[r] for r in range(n)]


def run_world(fn, world: int, tmp, *args, timeout: float = TIMEOUT_S,
              collective_timeout_s: float = 60.0) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{os.path.join(str(tmp), 'rendezvous')}"
    procs = [ctx.Process(target=_rank_entry,
                         args=(fn, r, world, init, q, args, collective_timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    return _collect(procs, q, world, timeout)


def run_driver(fn, *args, timeout: float = TIMEOUT_S):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_driver_entry, args=(fn, q, args))
    p.start()
    return _collect([p], q, 1, timeout)[0]
