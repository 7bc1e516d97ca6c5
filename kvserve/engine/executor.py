"""Executors: how the engine's step reaches the ranks that hold the model.

``UniProcExecutor`` is the single-process engine: one ``Worker`` (the whole model and KV
cache) in the engine's process, called directly.

``MultiprocExecutor`` is driver-worker tensor parallelism (vLLM's and nano-vllm's shape): the
engine's process is rank 0, the driver. It alone owns the scheduler, block pool, prefix cache
and integrity bookkeeping; it spawns ranks 1..tp-1, each a ``Worker`` holding its weight shards
and its KV heads. Per step the driver broadcasts a ``StepInput`` over the gloo CPU group as
one flat int64 tensor (``StepInput.to_tensor``: no pickle ever crosses ranks, unlike
``broadcast_object_list``), every rank runs the forward (activations reduced over the device
group), and the LM head gathers the logits to rank 0.

Sampling happens once, on rank 0, after that gather. Why not on every rank with identical
seeds (vLLM V1, SGLang)? Ranks could then disagree on a token if any reduction or sampling
kernel were not bitwise identical across ranks, and a disagreement is a hang or silent garbage;
sampling once removes the RNG coupling and costs one [N, V] gather, which rank 0 needs anyway
for logprobs. Workers never need the sampled tokens: the next ``StepInput`` carries them.

Control messages (all rank 0 -> every rank, on the gloo CPU group) are typed: one frozen
dataclass per kind in ``executor_messages`` (``Step``, ``Seal``, ``Verify``, ``Inject``,
``DumpKV``, ``Shutdown``, and the KV connectors' ``KVSave`` / ``KVLoad``), sent as a
versioned msgpack envelope with a type tag (plus the ``StepInput`` as an int64 tensor body)
and checked field by field on arrival. The header goes
on a group without a timeout on the workers (they wait for it however long the engine idles);
everything after it is bounded by the collective timeout. A worker runs exactly one handler
per message type (``HANDLERS``); the replies that follow some messages are collectives
(a gather or an all_reduce(MAX) to rank 0, documented on each message class).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np
import torch

from kvserve.cache.integrity import SliceSeals, content_hashes, inject_fault
from kvserve.cache.kv_connector import PEER_REASONS, BlockRef, KVConnector
from kvserve.distributed import parallel_state as ps
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.executor_messages import (
    HEADER_WORDS,
    DumpKV,
    Inject,
    KVLoad,
    KVSave,
    Message,
    MessageError,
    Seal,
    Shutdown,
    Step,
    Verify,
    decode_message,
    encode_message,
    frame_sizes,
)
from kvserve.engine.step_input import StepInput
from kvserve.engine.worker import Worker, WorkerConfig

logger = logging.getLogger("kvserve")

_EXIT_GRACE_S = 1.0  # after a failed collective: how long a dying worker's exit may take
_FAULT_KINDS = ("bitflip", "scale", "swap")


class Executor(Protocol):
    driver: Worker  # rank 0's worker (the whole model at tp=1)

    def execute(self, step: StepInput) -> list[torch.Tensor | None]: ...
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


class UniProcExecutor:
    """Today's single-process path: the driver worker is the model."""

    def __init__(self, config: WorkerConfig) -> None:
        self.driver = Worker(config)

    def execute(self, step: StepInput) -> list[torch.Tensor | None]:
        return self.driver.execute(step)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_executor(config: WorkerConfig) -> UniProcExecutor | MultiprocExecutor:
    if config.args.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    return MultiprocExecutor(config)


# ---- messages (kvserve.engine.executor_messages) ------------------------------------------
def _send(msg: Message) -> None:
    frame = encode_message(msg)
    ps.cpu_broadcast(frame.header, idle=True)
    if frame.spill is not None:
        ps.cpu_broadcast(frame.spill)
    if frame.body is not None and frame.body.numel():
        ps.cpu_broadcast(frame.body)


def _recv() -> Message:
    header = ps.cpu_broadcast(torch.zeros(HEADER_WORDS, dtype=torch.int64), idle=True)
    n_spill, n_body = frame_sizes(header)
    spill = ps.cpu_broadcast(torch.empty(n_spill, dtype=torch.int64)) if n_spill else None
    body = ps.cpu_broadcast(torch.empty(n_body, dtype=torch.int64)) if n_body else None
    return decode_message(header, spill, body)


def _block_fields(refs: list[BlockRef]) -> dict:
    """The block fields of ``KVSave`` / ``KVLoad``."""
    return {"block_ids": tuple(r.block_id for r in refs),
            "chain_hashes": tuple(r.chain_hash for r in refs),
            "token_ids": tuple(tuple(r.token_ids) for r in refs)}


def _refs(msg: KVSave | KVLoad) -> list[BlockRef]:
    return [BlockRef(b, h, t)
            for b, h, t in zip(msg.block_ids, msg.chain_hashes, msg.token_ids, strict=True)]


def _replica_message(key: int, sums: np.ndarray) -> torch.Tensor:
    """(replica key, content hash of each sealed block) for the seal-time comparison."""
    return torch.cat([torch.tensor([key]), torch.from_numpy(content_hashes(sums))])


def replica_mismatch(parts: list[torch.Tensor], block_ids: list[int]) -> list[bool]:
    """Per block: do two ranks with the same replica key (``parts[r][0]``) hold different
    content hashes (``parts[r][1:]``)? Logs which ranks disagree."""
    groups: dict[int, list[int]] = {}
    for r, p in enumerate(parts):
        groups.setdefault(int(p[0]), []).append(r)
    bad = torch.zeros(len(block_ids), dtype=torch.bool)
    for key, ranks in groups.items():
        if len(ranks) < 2:
            continue
        hashes = torch.stack([parts[r][1:] for r in ranks])  # [ranks, n]
        differ = (hashes != hashes[0]).any(dim=0)
        for i in differ.nonzero().flatten().tolist():
            votes: dict[int, list[int]] = {}
            for r, h in zip(ranks, hashes[:, i].tolist(), strict=True):
                votes.setdefault(h, []).append(r)
            logger.error("integrity: block %d: replicated copy %d differs across ranks (%s)",
                         block_ids[i], key, " vs ".join(str(v) for v in votes.values()))
        bad |= differ
    return bad.tolist()


def kv_bytes(worker: Worker) -> torch.Tensor:
    cache = worker.kv_cache
    parts = [cache.data.reshape(-1).view(torch.uint8)]
    if cache.scales is not None:
        parts.append(cache.scales.reshape(-1).view(torch.uint8))
    return torch.cat(parts).cpu()


class MultiprocExecutor:
    """Rank 0 of a tensor-parallel world (see the module docstring)."""

    def __init__(self, config: WorkerConfig) -> None:
        args = config.args
        tp = args.tensor_parallel_size  # validated by the builder (parallel_check)
        if ps.state() is not None:
            raise ValueError("tensor_parallel_size: another tensor-parallel engine is alive in "
                             "this process; call its engine.shutdown() first (one per process)")
        self.world_size = tp
        self._res = _Resources()
        init = args.distributed_init_method
        if init is None:
            self._res.tmp = tempfile.mkdtemp(prefix="kvserve-tp-")
            init = f"file://{os.path.join(self._res.tmp, 'rendezvous')}"
        _, local = local_ranks(args)  # other nodes (or torchrun) start their own ranks
        ctx = mp.get_context("spawn")
        threads = torch.get_num_threads()
        for r in local:
            p = ctx.Process(target=worker_main, args=(config, r, tp, init, threads),
                            name=f"kvserve-tp{r}", daemon=True)
            p.start()
            self._res.procs.append(p)
            self._res.ranks.append(r)
        self.procs = self._res.procs
        # Shut the workers down when this executor is collected or the process exits.
        self._finalizer = weakref.finalize(self, self._res.close)
        try:
            ps.init_distributed(init, 0, tp, device=args.device,
                                timeout_s=args.distributed_timeout_s,
                                enable_expert_parallel=args.enable_expert_parallel)
            self.driver = Worker(config, 0, tp)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (driver = rank 0), rendezvous %s", tp, init)

    # ---- liveness ----------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise ``DistributedError`` if a local worker process has exited, or an earlier
        collective failed (the group is then unusable for good)."""
        if self._res.closed:
            raise ps.DistributedError("the tensor-parallel executor was shut down")
        dead = self._dead_worker()
        if dead is not None:
            raise dead
        if self._res.failed is not None:
            raise ps.DistributedError(f"{self._res.failed}; the engine cannot continue")

    def _dead_worker(self) -> ps.DistributedError | None:
        for rank, p in zip(self._res.ranks, self.procs, strict=True):
            if p.exitcode is not None:
                msg = (f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code "
                       f"{p.exitcode}")
                self._res.failed = self._res.failed or msg
                return ps.DistributedError(f"{msg}; the engine cannot continue")
        return None

    def _failed(self, e: ps.DistributedError) -> ps.DistributedError:
        """The error to raise for a failed collective: a worker that exited is named (the
        collective failing is its consequence); otherwise the collective's own error and the
        local workers' states (a hung one shows, e.g. "stopped"; ranks on other nodes are
        not listed)."""
        deadline = time.monotonic() + _EXIT_GRACE_S  # the socket may close before the exit shows
        while (dead := self._dead_worker()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if dead is not None:
            return dead
        alive = ", ".join(f"rank {r} (pid {p.pid}, {_proc_state(p.pid)})"
                          for r, p in zip(self._res.ranks, self.procs, strict=True))
        self._res.failed = f"{e}; local workers: {alive or 'none'}"
        return ps.DistributedError(f"{self._res.failed}; the engine cannot continue")

    def _send(self, msg: Message) -> None:
        self.check_health()
        try:
            _send(msg)
        except ps.DistributedError as e:
            raise self._failed(e) from e

    # ---- the step ----------------------------------------------------------------------------
    def execute(self, step: StepInput) -> list[torch.Tensor | None]:
        self._send(Step(step))
        try:
            return self.driver.execute(step)
        except ps.DistributedError as e:
            raise self._failed(e) from e

    # ---- integrity across ranks (kvserve.cache.integrity.IntegrityPeers) ----------------------
    def seal(self, block_ids: list[int], generations: list[int], token_hashes: list[bytes],
             sums: np.ndarray) -> list[bool]:
        """Every rank seals its slice. Where ranks hold replicated copies (``Worker.
        replica_key``), their checksums must agree: rank 0 gathers each rank's content hashes
        and flags the blocks whose copies differ (the checker quarantines those and the
        requests holding them recompute, on every rank alike: only rank 0 schedules)."""
        self._send(Seal(tuple(block_ids), tuple(generations), tuple(token_hashes)))
        key = self.driver.replica_key
        if key is None:
            return [False] * len(block_ids)
        try:
            parts = ps.cpu_gather(_replica_message(key, sums))
        except ps.DistributedError as e:
            raise self._failed(e) from e
        assert parts is not None
        return replica_mismatch(parts, block_ids)

    def verify(self, block_ids: list[int], generations: list[int],
               local_bad: list[bool]) -> list[bool]:
        """Every rank checks its own slice of the blocks; a block is bad if it is bad on any
        rank (all_reduce MAX), and every rank learns the same verdict."""
        self._send(Verify(tuple(block_ids), tuple(generations)))
        try:
            mask = ps.cpu_all_reduce_max(torch.tensor(local_bad, dtype=torch.int64))
        except ps.DistributedError as e:
            raise self._failed(e) from e
        return [bool(x) for x in mask.tolist()]

    # ---- KV connectors across ranks (kvserve.cache.kv_connector.KVPeers) -------------------
    def kv_save(self, connector: str, refs: list[BlockRef], arg: str | None, wait: bool) -> int:
        """Every other rank's ``connector`` saves its slice of the blocks now (before the next
        step overwrites them); waits until all have (the gather), returns their bytes."""
        self._send(KVSave(connector, arg=msgpack.packb(arg), wait=wait, **_block_fields(refs)))
        try:
            parts = ps.cpu_gather(torch.zeros(1, dtype=torch.int64))
        except ps.DistributedError as e:
            raise self._failed(e) from e
        assert parts is not None
        return sum(int(p[0]) for p in parts[1:])

    def kv_load(self, connector: str, refs: list[BlockRef], arg: dict | None
                ) -> tuple[list[str | None], int]:
        """Every other rank's ``connector`` loads, verifies and installs its slice of the
        blocks (synchronous: the driver's own slice was loaded in the background); per block
        the reason some rank refused it (None: verified on every rank), and their bytes."""
        n = len(refs)
        self._send(KVLoad(connector, arg=msgpack.packb(arg), **_block_fields(refs)))
        try:
            parts = ps.cpu_gather(torch.zeros(1 + n, dtype=torch.int64))
        except ps.DistributedError as e:
            raise self._failed(e) from e
        assert parts is not None
        codes = torch.stack(parts[1:])[:, 1:].amax(dim=0).tolist() if n else []
        return ([PEER_REASONS[c - 1] if c else None for c in codes],
                sum(int(p[0]) for p in parts[1:]))

    def inject(self, rank: int, block_id: int, layer: int, kind: str, index: int = 0,
               bit: int = 0, other_index: int = 1) -> None:
        """Corrupt a block on another rank only (drills, tests)."""
        if not 0 < rank < self.world_size:
            raise ValueError(f"rank must be in [1, {self.world_size}), got {rank}")
        if kind not in _FAULT_KINDS:
            raise ValueError(f"kind must be one of {_FAULT_KINDS} on a worker rank, got {kind!r}")
        self._send(Inject(rank, block_id, layer, kind, index, bit, other_index))

    def gather_kv(self) -> list[torch.Tensor]:
        """Every rank's KV bytes (data, then FP8 scales) as flat uint8 on rank 0 (tests)."""
        self._send(DumpKV())
        try:
            parts = ps.cpu_gather(kv_bytes(self.driver))
        except ps.DistributedError as e:
            raise self._failed(e) from e
        assert parts is not None
        return parts

    def shutdown(self) -> None:
        self._finalizer()


class _Resources:
    """What a MultiprocExecutor must release (kept apart so a finalizer can hold it without
    keeping the executor alive)."""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.ranks: list[int] = []  # the rank of each local worker process
        self.tmp: str | None = None
        self.closed = False
        self.failed: str | None = None  # why the group is unusable (None while healthy)

    def close(self) -> None:
        """A clean ``Shutdown`` when every rank is healthy (workers exit 0); after a failure the
        surviving local workers are ended at once (one may hang in a collective or be
        stopped: SIGKILL, unlike SIGTERM, ends a stopped process too)."""
        if self.closed:
            return
        self.closed = True
        healthy = self.failed is None and all(p.exitcode is None for p in self.procs)
        try:
            if healthy and ps.state() is not None:
                _send(Shutdown())
        except ps.DistributedError:
            healthy = False
        for p in self.procs:
            p.join(timeout=30 if healthy else 0.5)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=2)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        ps.destroy_distributed()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _proc_state(pid: int) -> str:
    """A local process's state from /proc ("running", "sleeping", "stopped", ...)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(None, 2)[2].strip().strip("()")
    except OSError:
        pass
    return "state unknown"


def local_ranks(args: EngineArgs) -> tuple[bool, list[int]]:
    """(whether this process is the driver, rank 0; the worker ranks it must start here).

    ``env://`` (torchrun, srun): the launcher started one process per rank and set RANK;
    rank 0 drives, every other process is one worker. Otherwise node ``node_rank`` of
    ``nnodes`` hosts ranks [node_rank * tp / nnodes, (node_rank + 1) * tp / nnodes); node 0's
    first rank is the driver, which spawns the rest of its node."""
    tp = args.tensor_parallel_size
    if args.distributed_init_method == "env://":
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp:
            raise ValueError(f"tensor_parallel_size {tp} must equal the launcher's WORLD_SIZE "
                             f"{world} (env://)")
        return rank == 0, [] if rank == 0 else [rank]
    per_node = tp // args.nnodes
    ranks = list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))
    return (True, ranks[1:]) if args.node_rank == 0 else (False, ranks)


def run_headless(config: WorkerConfig, ranks: list[int]) -> int:
    """Run worker ranks on a node that is not the driver's; exit status 0 only if all of
    them ended cleanly (the driver's ``Shutdown``), non-zero if any died or timed out."""
    args = config.args
    tp, init = args.tensor_parallel_size, args.distributed_init_method
    assert init is not None
    threads = torch.get_num_threads()
    if args.distributed_init_method == "env://":  # this process is the rank
        try:
            worker_main(config, ranks[0], tp, init, threads)
        except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit
            logger.error("worker rank %d failed: %s", ranks[0], e)
            return 1
        return 0
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(config, r, tp, init, threads),
                         name=f"kvserve-tp{r}") for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [(r, p.exitcode) for r, p in zip(ranks, procs, strict=True) if p.exitcode != 0]
    for r, code in bad:
        logger.error("worker rank %d exited with code %s", r, code)
    return 1 if bad else 0


def worker_main(config: WorkerConfig, rank: int, world_size: int, init_method: str,
                threads: int = 1) -> None:
    """A worker rank: load this rank's shards, then serve the driver's messages until
    ``Shutdown``. Any failure (a dead driver, a timed-out collective, a malformed message)
    exits non-zero."""
    args = config.args
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.WARNING)
    ps.init_distributed(init_method, rank, world_size, device=args.device,
                        timeout_s=args.distributed_timeout_s,
                        enable_expert_parallel=args.enable_expert_parallel)
    try:
        worker = Worker(config, rank, world_size)
        worker.init_model_runner()
        state = WorkerRank(worker, SliceSeals(worker.kv_cache, worker.fingerprint),
                           worker.build_connectors())
        with torch.inference_mode():
            while not dispatch(state, _recv()):
                pass
    finally:
        ps.destroy_distributed()


@dataclass(frozen=True, slots=True)
class WorkerRank:
    """What a worker rank's handlers act on: its worker, seals and KV connectors."""

    worker: Worker
    seals: SliceSeals
    connectors: dict[str, KVConnector]

    @property
    def rank(self) -> int:
        return self.worker.rank

    def connector(self, msg: KVSave | KVLoad) -> KVConnector:
        c = self.connectors.get(msg.connector)
        if c is None:
            raise MessageError(f"rank {self.rank}: {type(msg).__name__} for KV connector "
                               f"{msg.connector!r}, which this rank lacks (the driver and "
                               "workers disagree on the config)")
        return c


# ---- one handler per message type: (rank state, message) -> True to leave the loop ----------
def _on_step(w: WorkerRank, m: Step) -> None:
    w.worker.execute(m.step)


def _on_seal(w: WorkerRank, m: Seal) -> None:
    sums = w.seals.seal(list(m.block_ids), list(m.generations), list(m.token_hashes))
    if w.worker.replica_key is not None:
        ps.cpu_gather(_replica_message(w.worker.replica_key, sums))


def _on_verify(w: WorkerRank, m: Verify) -> None:
    ids = list(m.block_ids)
    mask = torch.tensor(w.seals.verify(ids, list(m.generations)), dtype=torch.int64)
    agreed = ps.cpu_all_reduce_max(mask)
    w.seals.drop([b for b, bad in zip(ids, agreed.tolist(), strict=True) if bad])


def _on_inject(w: WorkerRank, m: Inject) -> None:
    if m.rank == w.rank:
        inject_fault(w.worker.kv_cache, m.block_id, m.layer, m.kind, index=m.index, bit=m.bit,
                     other_index=m.other_index)


def _on_dump_kv(w: WorkerRank, m: DumpKV) -> None:
    ps.cpu_gather(kv_bytes(w.worker))


def _on_kv_save(w: WorkerRank, m: KVSave) -> None:
    nbytes = w.connector(m).save_slice(_refs(m), msgpack.unpackb(m.arg), m.wait)
    ps.cpu_gather(torch.tensor([nbytes]))


def _on_kv_load(w: WorkerRank, m: KVLoad) -> None:
    codes, nbytes = w.connector(m).load_slice(_refs(m), msgpack.unpackb(m.arg))
    ps.cpu_gather(torch.tensor([nbytes, *codes], dtype=torch.int64))


def _on_shutdown(w: WorkerRank, m: Shutdown) -> bool:
    for c in w.connectors.values():
        c.close()
    return True


HANDLERS: dict[type, Callable[[WorkerRank, Any], bool | None]] = {
    Step: _on_step, Seal: _on_seal, Verify: _on_verify, Inject: _on_inject,
    DumpKV: _on_dump_kv, Shutdown: _on_shutdown, KVSave: _on_kv_save, KVLoad: _on_kv_load,
}


def dispatch(state: WorkerRank, msg: Message) -> bool:
    """Run ``msg``'s handler; True when the worker must leave its loop (``Shutdown``)."""
    handler = HANDLERS.get(type(msg))
    if handler is None:
        raise MessageError(f"rank {state.rank}: no handler for {type(msg).__name__}")
    return bool(handler(state, msg))
