"""Process groups for tensor (and expert) parallelism, and the collectives the layers use.

One TP group spans all ranks (world size = tensor_parallel_size). Like vLLM's
``GroupCoordinator`` it holds two groups created on every rank in the same order:

    device_group  the device's backend (gloo on CPU, NCCL on CUDA): activations, logits
    cpu_group     always gloo: the driver's step inputs and integrity votes (small int64
                  tensors), so control traffic never needs the accelerator

Every collective runs under the timeout given to ``init_distributed``, so a rank that dies or
hangs turns into an exception on the others, never a silent hang. Two more gloo groups exist
for waits that are not hangs: the workers' wait for the driver's next message header (the
driver's send of it still times out) and start-up (ranks finish loading at different times).

Without ``init_distributed`` (the single-process engine) tp size is 1, tp rank 0 and every
collective is the identity: layers call these helpers unconditionally.

This module sits at the bottom of the import graph (torch only): layers, models, cache and
engine may import it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


class DistributedError(RuntimeError):
    """A collective failed or timed out: a peer rank died or hangs."""


@dataclass(frozen=True, slots=True)
class ParallelState:
    rank: int
    world_size: int
    device_group: object  # dist.ProcessGroup
    cpu_group: object  # dist.ProcessGroup (gloo)
    timeout_s: float
    # gloo: the driver's message headers. A worker waits on it without a practical timeout
    # (an idle engine is not a hung one; a dead driver closes the sockets, which fails at
    # once), but the driver sends under ``timeout_s``: a gloo send completes only once the
    # receiver has posted its receive, so a worker stopped between two messages would
    # otherwise hang the driver for good.
    idle_group: object
    # gloo, no practical timeout on any rank: start-up, where ranks finish loading at
    # different times (a rank that dies while loading closes its sockets: fails at once)
    startup_group: object
    enable_expert_parallel: bool = False


_STATE: ParallelState | None = None


def init_distributed(init_method: str, rank: int, world_size: int, *, device: str = "cpu",
                     timeout_s: float = DEFAULT_TIMEOUT_S,
                     enable_expert_parallel: bool = False) -> ParallelState:
    """Join the TP group. ``init_method``: ``file:///tmp/x``, ``tcp://host:port`` or
    ``env://`` (torchrun / srun set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    global _STATE
    assert _STATE is None, "init_distributed called twice"
    if _is_local(init_method):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":  # one GPU per rank: "cuda" then means this rank's device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) %
                              torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    forever = datetime.timedelta(days=365)
    # the timeout is each rank's own: the sender (rank 0) times out, the receivers wait
    idle_group = dist.new_group(list(range(world_size)), backend="gloo",
                                timeout=timeout if rank == 0 else forever)
    startup_group = dist.new_group(list(range(world_size)), backend="gloo", timeout=forever)
    _STATE = ParallelState(rank, world_size, device_group, cpu_group, timeout_s, idle_group,
                           startup_group, enable_expert_parallel)
    return _STATE


def _is_local(init_method: str) -> bool:
    return init_method.startswith("file://") or "127.0.0.1" in init_method \
        or "localhost" in init_method


def destroy_distributed() -> None:
    global _STATE
    if _STATE is not None and dist.is_initialized():
        with contextlib.suppress(Exception):  # a dead peer: nothing to tear down cleanly
            dist.destroy_process_group()
    _STATE = None


def state() -> ParallelState | None:
    return _STATE


def get_tp_rank() -> int:
    return _STATE.rank if _STATE is not None else 0


def get_tp_size() -> int:
    return _STATE.world_size if _STATE is not None else 1


def expert_parallel() -> bool:
    return _STATE is not None and _STATE.enable_expert_parallel


def _run(what: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # gloo raises RuntimeError on a timeout or a closed peer
        raise DistributedError(f"{what} failed on rank {get_tp_rank()}: a peer rank died, "
                               f"hung past {_STATE.timeout_s if _STATE else 0:.0f} s, or "
                               f"disagrees on the collective order ({e})") from e


# ---- device-group collectives (activations) -------------------------------------------------
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks, in place; identity at tp=1."""
    if _STATE is None or _STATE.world_size == 1:
        return x
    _run("all_reduce", lambda: dist.all_reduce(x, group=_STATE.device_group))
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``."""
    if _STATE is None or _STATE.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)]
    _run("all_gather", lambda: dist.all_gather(parts, x.contiguous(), group=_STATE.device_group))
    return torch.cat(parts, dim=dim)


def tp_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenation along ``dim`` on rank 0 (None on the others): the LM head's logits go
    only where they are sampled."""
    if _STATE is None or _STATE.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)] if _STATE.rank == 0 else None
    _run("gather", lambda: dist.gather(x, parts, dst=0, group=_STATE.device_group))
    return torch.cat(parts, dim=dim) if parts is not None else None


# ---- cpu-group collectives (control) ---------------------------------------------------------
def cpu_broadcast(x: torch.Tensor, idle: bool = False) -> torch.Tensor:
    """Broadcast a CPU tensor from rank 0 over the gloo group (in place on the receivers).
    ``idle``: the message header a worker waits for between steps (no timeout on the
    workers; the driver's send still times out, see ``ParallelState.idle_group``)."""
    assert _STATE is not None
    group = _STATE.idle_group if idle else _STATE.cpu_group
    _run("broadcast", lambda: dist.broadcast(x, src=0, group=group))
    return x


def cpu_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    assert _STATE is not None
    _run("all_reduce(MAX)",
         lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_STATE.cpu_group))
    return x


def cpu_all_reduce_min(x: torch.Tensor, startup: bool = False) -> torch.Tensor:
    """``startup``: at start-up, where ranks finish loading at different times (a rank that
    dies while loading closes its sockets, which fails this at once)."""
    assert _STATE is not None
    group = _STATE.startup_group if startup else _STATE.cpu_group
    _run("all_reduce(MIN)",
         lambda: dist.all_reduce(x, op=dist.ReduceOp.MIN, group=group))
    return x


def cpu_gather(x: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's ``x`` (same shape) on rank 0; None elsewhere."""
    assert _STATE is not None
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)] if _STATE.rank == 0 else None
    _run("gather", lambda: dist.gather(x.contiguous(), parts, dst=0, group=_STATE.cpu_group))
    return parts


def divide(n: int, tp: int, what: str) -> int:
    assert n % tp == 0, f"{what} {n} not divisible by tp {tp} (validated earlier)"
    return n // tp
