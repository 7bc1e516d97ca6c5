"""KV-cache integrity: seal full blocks with a checksum over payload, scales and identity;
verify before reuse, scrub in the background, repair by recomputation.

Checksum (per block, per layer): the block's bytes viewed as signed 16-bit words w_i,
i = 0..N-1 in row-major order of data[layer, block] = [C, bs, H, D] (and separately of the
FP8 bf16 scales / INT8 1-byte scale codes [C, bs, H], whose bytes pair up into words the same
way; an INT8 cache needs C * bs * H even), reduced to two exact integer sums

    S1 = sum_i w_i            S2 = sum_i (i + 1) * w_i          (int64, no wrap-around)

Why this and not XOR / CRC:
  * one flipped bit changes w_i by +-2^k, so S1 changes: every single-bit flip is caught;
  * two flips: S1 is unchanged only if they are the same bit k in opposite directions in two
    different words i != j, and then S2 changes by 2^k (i - j) != 0: every double flip is caught
    (a wrapping 64-bit Fletcher sum would miss 2^63 (i - j) for even i - j; here N*N*2^15 < 2^63);
  * two words swapped: S1 is unchanged and S2 changes by (i - j)(w_j - w_i) != 0: caught
    (XOR and plain sums miss every swap);
  * S2 = C * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c over the [R, C] word matrix, so both
    sums are two vectorized numpy reductions (``block_sums_numpy``, the twin), one pass of a
    small C kernel over the cache in place (``kvserve/csrc/block_sums.c``, ~1 us per 16 KiB
    block), and a GPU kernel can accumulate them per written token (each token's words
    contribute independently).
Where the sums of a seal come from: on the CPU/torch path ``seal`` recomputes them from the
bytes (``block_sums``). With a Triton backend the fused write kernel accumulates each written
token's contribution into ``csum_state[l, b]`` of the cache (reference.write_kv /
token_checksum_contrib); ``on_allocate`` zeroes a block's row whenever the block is
(re)allocated (preemption, reuse, rollback repair all go through allocation), and a block is
sealed only once full, i.e. after each of its rows was written exactly once since that reset,
so the state equals the recomputed sums exactly and sealing reads 32 B per block and layer
instead of the block. Verification always recomputes from the bytes: that is the check.
The sealed record is blake2b(fingerprint, block id, allocation generation, token-chain hash,
per-layer sums): a block that was freed and reused (new generation), or holds other tokens, or
belongs to another model/KV dtype, fails verification even if its bytes are intact.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.kv_cache import PagedKVCache
from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import block_sums as c_block_sums

T = TypeVar("T")

logger = logging.getLogger("kvserve.integrity")

# Fraction of step time the background scrubber may spend (the target overhead).
SCRUB_TIME_FRACTION = 0.003
# The auto scrubber saves its per-step credit up to this many blocks per verify call.
SCRUB_BATCH = 16


class IntegrityError(RuntimeError):
    """Raised only when a corrupted block cannot be repaired by recomputation."""


@dataclass(slots=True)
class _Seal:
    digest: bytes
    token_hash: bytes
    sums: np.ndarray  # [L, 4] int64: S1, S2 (payload), S1, S2 (scales)


def block_sums(kv_cache: PagedKVCache, block_ids: list[int]) -> np.ndarray:
    """[n, L, 4] int64 checksum sums of the given blocks, all layers (see module docstring).
    On a CPU cache this is the C kernel ``kvserve/csrc/block_sums.c`` reading the cache in
    place (one pass, ~10x the numpy reductions); its twin is ``block_sums_numpy``."""
    if kv_cache.data.is_cuda or c_block_sums.load() is None:
        return block_sums_numpy(kv_cache, block_ids)
    ids = np.asarray(block_ids, dtype=np.int64)
    out = np.empty((len(ids), kv_cache.num_layers, 4), dtype=np.int64)
    pay = np.empty((len(ids), kv_cache.num_layers, 2), dtype=np.int64)
    c_block_sums.region_sums(kv_cache.data, ids, pay)
    out[:, :, 0:2] = pay
    if kv_cache.scales is not None:
        c_block_sums.region_sums(kv_cache.scales, ids, pay)
        out[:, :, 2:4] = pay
    else:
        out[:, :, 2:4] = 0
    return out


def block_sums_numpy(kv_cache: PagedKVCache, block_ids: list[int]) -> np.ndarray:
    """The twin of ``block_sums``: the reference checksum of each layer's blocks
    (:func:`kvserve.kernels.reference.block_checksum_state`, the one specification)."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    per_layer = [ref.block_checksum_state(kv_cache.data, kv_cache.scales, layer, ids)
                 for layer in range(kv_cache.num_layers)]  # L x [n, 4]
    return torch.stack(per_layer, 1).cpu().numpy()


def write_state_sums(state: torch.Tensor, block_ids: list[int]) -> np.ndarray:
    """[n, L, 4] int64 sums of the given blocks from the accumulated write state
    ``state [L, NB+1, 4]`` (one small device->host copy; no read of the KV bytes)."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=state.device)
    return state.index_select(1, idx).permute(1, 0, 2).contiguous().cpu().numpy()


def _timed(kind: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Method decorator: add the call's wall time to ``self.seconds[kind]``."""

    def deco(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def wrapper(self: IntegrityChecker, *args, **kwargs) -> T:
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - t0

        return wrapper

    return deco


def _digest(fingerprint: bytes, block_id: int, generation: int, token_hash: bytes,
            sums: np.ndarray) -> bytes:
    h = hashlib.blake2b(fingerprint, digest_size=16)
    h.update(np.array([block_id, generation], dtype=np.int64).tobytes())
    h.update(token_hash)
    h.update(sums.tobytes())
    return h.digest()


def content_hashes(sums: np.ndarray) -> np.ndarray:
    """[n, L, 4] block sums -> [n] int64: one 64-bit hash of each block's payload and scale
    checksums (no identity), comparable across ranks that hold the same bytes."""
    out = np.empty(len(sums), dtype=np.int64)
    for i, s in enumerate(sums):
        out[i] = np.frombuffer(hashlib.blake2b(np.ascontiguousarray(s).tobytes(),
                                               digest_size=8).digest(), dtype=np.int64)[0]
    return out


class IntegrityPeers(Protocol):
    """The other tensor-parallel ranks (kvserve.engine.executor.MultiprocExecutor): each holds
    its own slice (KV heads) of every block and seals / verifies that slice itself."""

    def seal(self, block_ids: list[int], generations: list[int], token_hashes: list[bytes],
             sums: np.ndarray) -> list[bool]:
        """Seal on every rank; ``sums`` are rank 0's. Returns, per block, whether ranks that
        hold replicated copies (MLA latent, replicated KV heads) sealed different bytes."""
        ...

    def verify(self, block_ids: list[int], generations: list[int],
               local_bad: list[bool]) -> list[bool]: ...


class SliceSeals:
    """A worker rank's seals over its slice of the KV cache. The driver (rank 0) decides what
    to seal and verify and sends the block ids and allocation generations; the digest binds
    this rank's fingerprint (which includes the parallel layout), so a slice is only ever
    compared with its own seal."""

    def __init__(self, kv_cache: PagedKVCache, fingerprint: bytes) -> None:
        self.kv_cache, self.fingerprint = kv_cache, fingerprint
        self.seals: dict[int, tuple[bytes, bytes]] = {}  # block -> (digest, token hash)

    def seal(self, block_ids: list[int], generations: list[int],
             token_hashes: list[bytes]) -> np.ndarray:
        """Seal this rank's slice of the blocks; returns their sums [n, L, 4]."""
        sums = block_sums(self.kv_cache, block_ids) if block_ids else np.zeros(
            (0, self.kv_cache.num_layers, 4), dtype=np.int64)
        for i, (b, g, th) in enumerate(zip(block_ids, generations, token_hashes, strict=True)):
            self.seals[b] = (_digest(self.fingerprint, b, g, th, sums[i]), th)
        return sums

    def verify(self, block_ids: list[int], generations: list[int]) -> list[bool]:
        """Bad flags, one per block: unsealed here, or its bytes or identity (generation)
        changed since it was sealed."""
        sealed = [b for b in block_ids if b in self.seals]
        bad = {b for b in block_ids if b not in self.seals}
        if sealed:
            sums = block_sums(self.kv_cache, sealed)
            gen = dict(zip(block_ids, generations, strict=True))
            for i, b in enumerate(sealed):
                digest, th = self.seals[b]
                if _digest(self.fingerprint, b, gen[b], th, sums[i]) != digest:
                    bad.add(b)
                    logger.error("integrity: block %d failed verification on this rank", b)
        return [b in bad for b in block_ids]

    def drop(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.seals.pop(b, None)


def inject_fault(kv_cache: PagedKVCache, block_id: int, layer: int = 0, kind: str = "bitflip", *,
                 index: int = 0, bit: int = 0, other_index: int = 1) -> None:
    """Corrupt a block's bytes on purpose (tests, drills); see ``IntegrityChecker.inject``."""
    if not 0 <= block_id < kv_cache.num_blocks:
        raise ValueError(f"block_id must be in [0, {kv_cache.num_blocks}), got {block_id}")
    if not 0 <= layer < kv_cache.num_layers:
        raise ValueError(f"layer must be in [0, {kv_cache.num_layers}), got {layer}")
    if kind == "bitflip":
        raw = kv_cache.data[layer, block_id].view(-1).view(torch.uint8)
        raw[index % raw.numel()] ^= 1 << (bit % 8)
    elif kind == "scale":
        if kv_cache.scales is None:
            raise ValueError("kind='scale' needs an FP8 or INT8 KV cache")
        raw = kv_cache.scales[layer, block_id].reshape(-1).view(torch.uint8)
        raw[index % raw.numel()] ^= 1 << (bit % 8)
    elif kind == "swap":
        words = kv_cache.data[layer, block_id].view(-1).view(torch.int32)
        i, j = index % words.numel(), other_index % words.numel()
        a, b = words[i].clone(), words[j].clone()
        words[i], words[j] = b, a
    else:
        raise ValueError(f"kind must be bitflip, scale, swap or stale; got {kind!r}")


class IntegrityChecker:
    def __init__(self, kv_cache: PagedKVCache, pool: BlockPool, fingerprint: bytes, mode: str,
                 scrub_blocks_per_step: int = 0, peers: IntegrityPeers | None = None) -> None:
        assert mode in ("on", "paranoid")
        self.kv_cache, self.pool, self.fingerprint, self.mode = kv_cache, pool, fingerprint, mode
        # Tensor parallel: the other ranks' slices (sealed and verified there, verdicts agreed).
        self.peers = peers
        self.scrub_blocks_per_step = scrub_blocks_per_step
        self.seals: dict[int, _Seal] = {}
        self.checks: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.repairs: Counter[str] = Counter()
        self._pending: set[int] = set()  # quarantined blocks whose holders need a rollback
        self._scrub_queue: list[int] = []
        self._scrub_credit = 0.0
        self._block_cost = 0.0  # EMA seconds to verify one block
        self._step_start: float | None = None
        self._step_time = 0.0  # EMA seconds per engine step (begin_step .. end_step)
        self.scrub_seconds = 0.0
        self.seal_sources: Counter[str] = Counter()  # blocks sealed from write_state/recompute
        # Wall seconds spent in integrity work, by kind (seal, verify incl. scrub / paranoid /
        # reuse, allocate): the direct cost measure, beside tok/s comparisons.
        self.seconds: Counter[str] = Counter()

    # ---- sealing --------------------------------------------------------------------------
    def _digest(self, block_id: int, token_hash: bytes, sums: np.ndarray) -> bytes:
        gen = self.pool.blocks[block_id].generation
        return _digest(self.fingerprint, block_id, gen, token_hash, sums)

    @_timed("allocate")
    def on_allocate(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.seals.pop(b, None)
        state = self.kv_cache.csum_state
        if state is not None and block_ids:
            # New owner, new contents: the write kernel accumulates from zero.
            idx = torch.tensor(block_ids, dtype=torch.int64, device=state.device)
            state.index_fill_(1, idx, 0)

    @_timed("seal")
    def seal(self, block_ids: list[int], token_hashes: list[bytes]) -> None:
        if not block_ids:
            return
        state = self.kv_cache.csum_state
        if state is not None:
            sums = write_state_sums(state, block_ids)
            self.seal_sources["write_state"] += len(block_ids)
        else:
            sums = block_sums(self.kv_cache, block_ids)
            self.seal_sources["recompute"] += len(block_ids)
        for i, (b, th) in enumerate(zip(block_ids, token_hashes, strict=True)):
            self.seals[b] = _Seal(self._digest(b, th, sums[i]), th, sums[i])
        if self.peers is not None:
            diverged = self.peers.seal(
                block_ids, [self.pool.blocks[b].generation for b in block_ids], token_hashes,
                sums)
            for b, bad in zip(block_ids, diverged, strict=True):
                if bad:  # two ranks' copies of a replicated block differ: neither is trusted
                    logger.error("integrity: block %d: its replicated copies differ across "
                                 "tensor-parallel ranks (at seal)", b)
                    self.failures["replica"] += 1
                    self.seals.pop(b, None)
                    self.pool.quarantine(b)
                    self._pending.add(b)

    def is_sealed(self, block_id: int) -> bool:
        return block_id in self.seals

    def sealed_sums(self, block_id: int) -> np.ndarray | None:
        """The sums [L, 4] a block was sealed with (None: unsealed); the KV tiers store them."""
        seal = self.seals.get(block_id)
        return None if seal is None else seal.sums

    # ---- verification ---------------------------------------------------------------------
    @_timed("verify")
    def verify(self, block_ids: list[int], reason: str) -> list[int]:
        """Check sealed blocks; quarantine and return the bad ones (unsealed ones are bad too:
        nothing may be reused that was never sealed)."""
        ids = [b for b in block_ids if not self.pool.blocks[b].quarantined]
        if not ids:
            return []
        self.checks[reason] += len(ids)
        sealed = [b for b in ids if b in self.seals]
        bad = [b for b in ids if b not in self.seals]
        if sealed:
            sums = block_sums(self.kv_cache, sealed)
            for i, b in enumerate(sealed):
                seal = self.seals[b]
                if self._digest(b, seal.token_hash, sums[i]) != seal.digest:
                    bad.append(b)
                    self._report(b, reason, sums[i], seal)
        if self.peers is not None:
            # one block's KV is spread over every rank: bad anywhere = bad everywhere
            local = set(bad)
            agreed = self.peers.verify(ids, [self.pool.blocks[b].generation for b in ids],
                                       [b in local for b in ids])
            for b, flag in zip(ids, agreed, strict=True):
                if flag and b not in local:
                    logger.error("integrity: block %d failed verification on another "
                                 "tensor-parallel rank (%s)", b, reason)
                    bad.append(b)
        for b in bad:
            if b not in self.seals:
                logger.error("integrity: block %d was never sealed (%s)", b, reason)
            self.failures[reason] += 1
            self.seals.pop(b, None)
            self.pool.quarantine(b)
            self._pending.add(b)
        return bad

    def _report(self, block_id: int, reason: str, sums: np.ndarray, seal: _Seal) -> None:
        layers = [int(x) for x in np.nonzero((sums != seal.sums).any(axis=1))[0]]
        what = f"layer(s) {layers}" if layers else "identity (generation/tokens/fingerprint)"
        logger.error("integrity: block %d failed verification (%s): %s", block_id, reason, what)

    # ---- per-step hook --------------------------------------------------------------------
    def begin_step(self, held_blocks: Callable[[], list[int]]) -> list[int]:
        """Called at the start of every engine step: paranoid checks of the blocks running
        requests hold (``held_blocks()``), or a scrub batch. Returns the blocks found bad since
        the last call (here or by a prefix-hit check), already quarantined: the scheduler rolls
        back the requests holding them (``Scheduler.rollback``) and reports them with
        ``record_rollbacks``."""
        self._step_start = time.perf_counter()
        if self.mode == "paranoid":
            held = sorted({b for b in held_blocks() if b in self.seals})
            if held:
                self.verify(held, "paranoid")
        else:
            self._scrub()
        bad, self._pending = sorted(self._pending), set()
        return bad

    def record_rollbacks(self, num_requests: int) -> None:
        """Count requests rolled back to recompute from their last good block."""
        if num_requests:
            self.repairs["rollback"] += num_requests

    def end_step(self) -> None:
        """Called when an engine step's work is done: the scrub budget is a fraction of the
        engine's own step time (not of the wall time between steps, which includes the
        caller's work)."""
        if self._step_start is not None:
            dt = time.perf_counter() - self._step_start
            self._step_time = dt if not self._step_time else 0.9 * self._step_time + 0.1 * dt
            self._step_start = None

    def _scrub(self) -> None:
        n = self.scrub_blocks_per_step
        if n == 0:  # auto: spend SCRUB_TIME_FRACTION of the step time, at least 1 per 64 steps
            cost = self._block_cost or 1e-5
            self._scrub_credit += max(SCRUB_TIME_FRACTION * self._step_time / cost, 1 / 64)
            # verify in batches: one call has ~50 us of fixed cost, a block ~2 us more
            if self._scrub_credit < min(SCRUB_BATCH, len(self.seals)):
                return
            n = int(self._scrub_credit)
            self._scrub_credit -= n
        if n <= 0 or not self.seals:
            return
        batch = []
        while len(batch) < n:
            if not self._scrub_queue:
                self._scrub_queue = list(self.seals)
                if not self._scrub_queue:
                    break
            b = self._scrub_queue.pop()
            if b in self.seals and b not in batch:
                batch.append(b)
            if len(batch) >= len(self.seals):
                break
        if not batch:
            return
        t0 = time.perf_counter()
        self.verify(batch, "scrub")
        dt = time.perf_counter() - t0
        self.scrub_seconds += dt
        per = dt / len(batch)
        self._block_cost = per if not self._block_cost else 0.8 * self._block_cost + 0.2 * per

    # ---- fault injection ------------------------------------------------------------------
    def inject(self, block_id: int, layer: int = 0, kind: str = "bitflip", *,
               index: int = 0, bit: int = 0, other_index: int = 1) -> None:
        """Corrupt a block on purpose (tests, drills). ``index`` is a byte offset (bitflip,
        scale) or an int32-word offset (swap) within data[layer, block_id]."""
        if kind == "stale":
            if not 0 <= block_id < self.kv_cache.num_blocks:
                raise ValueError(f"block_id must be in [0, {self.kv_cache.num_blocks}), got "
                                 f"{block_id}")
            if not 0 <= layer < self.kv_cache.num_layers:
                raise ValueError(f"layer must be in [0, {self.kv_cache.num_layers}), got {layer}")
            # The block is "freed and reallocated" under its holder: new generation, new bytes.
            self.pool.blocks[block_id].generation += 1
            self.kv_cache.data[layer, block_id].view(-1).view(torch.uint8)[index % 64] ^= 0x10
            return
        inject_fault(self.kv_cache, block_id, layer, kind, index=index, bit=bit,
                     other_index=other_index)

    def stats(self) -> dict:
        return {
            "checks": dict(self.checks), "failures": dict(self.failures),
            "repairs": dict(self.repairs), "sealed_blocks": len(self.seals),
            "quarantined_blocks": self.pool.num_quarantined,
            "scrub_seconds": self.scrub_seconds, "seal_sources": dict(self.seal_sources),
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
        }
