"""The stored-block format: one sealed KV block (every layer's payload and scales of this rank)
as a self-describing byte string, and the check that reads one back.

Used wherever a block leaves the pool (the host-memory and disk tiers, ``kv_tiers.py``; the
same bytes can cross a process or machine boundary). Nothing here is pickled; nothing read back
is used before ``verify`` accepted all of it.

Layout (little-endian)::

    magic    8 B    b"KVSBLK\\x00\\x01"
    hlen     4 B    uint32: length of the header
    header   hlen   UTF-8 JSON (sorted keys): identity and the body's layout, see StoreSpec
    sums     L*32   int64 [L, 4]: per layer S1, S2 (payload), S1, S2 (scales): the seal's sums
    payload  ...    data[:, block]    [L, C, bs, H, D] in the cache's storage dtype
    scales   ...    scales[:, block]  [L, C, bs, H] (FP8: bf16, INT8: 1-byte codes); absent
                    for 16/32-bit modes
    digest   32 B   blake2b-256 of everything above

``verify`` checks, in this order, and names the first failure (``Reason``): the magic and the
header parse (bad_header), the format version (wrong_version), the length (short_file), the
digest (bad_checksum: any flipped bit anywhere, in payload, scales, sums or header), then the
identity against what the reader expects: model, KV mode, rotation, rank / world size, the
layout (block size, layers, heads, dtype), the combined fingerprint, the token-chain hash
(wrong_block: another block's file under this name), the block's token ids (wrong_tokens), and
last the sums recomputed from the payload and scales (bad_sums: an internally consistent file
whose bytes are not what was sealed).
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.kernels import reference as ref
from kvserve.kernels.cpu import block_sums as c_block_sums

if TYPE_CHECKING:
    from kvserve.cache.kv_cache import PagedKVCache

MAGIC = b"KVSBLK\x00\x01"
FORMAT_VERSION = 1
DIGEST_BYTES = 32
_HLEN = struct.Struct("<I")
_MAX_HEADER = 1 << 20


class Reason(enum.StrEnum):
    """Why a stored block was refused (the ``reason`` label of the rejection counter)."""

    BAD_HEADER = "bad_header"
    WRONG_VERSION = "wrong_version"
    SHORT_FILE = "short_file"
    BAD_CHECKSUM = "bad_checksum"
    WRONG_MODEL = "wrong_model"
    WRONG_KV_MODE = "wrong_kv_mode"
    WRONG_ROTATION = "wrong_rotation"
    WRONG_RANK = "wrong_rank"
    WRONG_LAYOUT = "wrong_layout"
    WRONG_FINGERPRINT = "wrong_fingerprint"
    WRONG_BLOCK = "wrong_block"
    WRONG_TOKENS = "wrong_tokens"
    BAD_SUMS = "bad_sums"
    UNREADABLE = "unreadable"


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """What every block of one engine rank shares: its identity and the body's layout. A
    reader accepts a block only if the writer's spec equals its own, field by field."""

    model: str  # hex id of the model files (config + weights)
    kv_mode: str  # KVMode.name: bf16, fp8_e4m3_rot, int8, ...
    rotation: str  # KVRotation.describe() or "" (unrotated)
    fingerprint: str  # hex of the engine fingerprint (binds all of the above and more)
    block_size: int
    num_layers: int
    components: int  # 2 (K, V) or 1 (MLA latent)
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    dtype: str  # storage dtype, e.g. "float8_e4m3fn"
    scale_dtype: str  # "" when the mode has no scales
    rank: int = 0
    world_size: int = 1

    @property
    def payload_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.components, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self.payload_shape[:-1]

    def nbytes(self) -> tuple[int, int, int]:
        """(sums, payload, scales) byte lengths of a body."""
        pay = int(np.prod(self.payload_shape)) * _dtype(self.dtype).itemsize
        sc = int(np.prod(self.scale_shape)) * _dtype(self.scale_dtype).itemsize \
            if self.scale_dtype else 0
        return self.num_layers * 32, pay, sc

    @property
    def block_bytes(self) -> int:
        """Size of one serialized block's body and digest (the header adds ~1 KiB)."""
        return sum(self.nbytes()) + DIGEST_BYTES


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block's content. payload [L, C, bs, H, D], scales [L, C, bs, H] or None (both CPU),
    sums int64 [L, 4] (the seal's: S1, S2 payload, S1, S2 scales)."""

    chain_hash: bytes
    token_ids: tuple[int, ...]
    payload: torch.Tensor
    scales: torch.Tensor | None
    sums: np.ndarray


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: Reason
    detail: str = ""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def block_sums(payload: torch.Tensor, scales: torch.Tensor | None) -> np.ndarray:
    """[n, L, 4] int64 integrity sums of stand-alone blocks payload [L, n, C, bs, H, D] and
    scales [L, n, C, bs, H] (CPU): the same numbers ``kvserve.cache.integrity`` seals (the C
    kernel when it builds, else the reference ``block_checksum_state``)."""
    L, n = payload.shape[0], payload.shape[1]
    out = np.zeros((n, L, 4), dtype=np.int64)
    if n == 0:
        return out
    payload = payload.contiguous()
    scales = None if scales is None else scales.contiguous()
    if not payload.is_cuda and c_block_sums.load() is not None:
        ids = np.arange(n, dtype=np.int64)
        tmp = np.empty((n, L, 2), dtype=np.int64)
        c_block_sums.region_sums(payload, ids, tmp)
        out[:, :, 0:2] = tmp
        if scales is not None:
            c_block_sums.region_sums(scales, ids, tmp)
            out[:, :, 2:4] = tmp
        return out
    ids = torch.arange(n)
    for layer in range(L):
        out[:, layer] = ref.block_checksum_state(payload, scales, layer, ids).cpu().numpy()
    return out


def serialize(spec: StoreSpec, block: StoredBlock) -> bytes:
    """One block as the bytes described in the module docstring."""
    if tuple(block.payload.shape) != spec.payload_shape:
        raise ValueError(f"payload shape {tuple(block.payload.shape)} != {spec.payload_shape}")
    if (block.scales is None) != (not spec.scale_dtype):
        raise ValueError("scales present iff the spec has a scale dtype")
    if not 0 < len(block.token_ids) <= spec.block_size:
        # fewer: the partly filled last block of a prompt sent to a decode replica
        # (kv_transfer.py); its unfilled rows are zero and the sums are taken when it is sent
        raise ValueError(f"a block holds 1..{spec.block_size} tokens, "
                         f"got {len(block.token_ids)}")
    header = {
        "version": FORMAT_VERSION,
        "spec": asdict(spec),
        "chain_hash": block.chain_hash.hex(),
        "token_ids": [int(t) for t in block.token_ids],
    }
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    sums = np.ascontiguousarray(block.sums, dtype="<i8")
    assert sums.shape == (spec.num_layers, 4)
    parts = [MAGIC, _HLEN.pack(len(hb)), hb, sums.tobytes(), _as_bytes(block.payload)]
    if block.scales is not None:
        parts.append(_as_bytes(block.scales))
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for p in parts:
        h.update(p)
    parts.append(h.digest())
    return b"".join(parts)


def read_header(data: bytes) -> dict | Rejected:
    """The parsed header (no digest check: for tools and the verifier's first step)."""
    if len(data) < len(MAGIC) + _HLEN.size:
        return Rejected(Reason.SHORT_FILE, f"{len(data)} bytes")
    if data[: len(MAGIC)] != MAGIC:
        return Rejected(Reason.BAD_HEADER, "not a kvserve block (magic)")
    (hlen,) = _HLEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _HLEN.size
    if hlen > _MAX_HEADER:
        return Rejected(Reason.BAD_HEADER, f"header length {hlen}")
    if len(data) < start + hlen:
        return Rejected(Reason.SHORT_FILE, "ends inside the header")
    try:
        header = json.loads(bytes(data[start: start + hlen]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return Rejected(Reason.BAD_HEADER, f"header: {e}")
    if not isinstance(header, dict):
        return Rejected(Reason.BAD_HEADER, "header is not an object")
    header["_body_start"] = start + hlen
    return header


# Identity fields in the order they are compared, and the reason each mismatch is.
_IDENTITY = (
    ("model", Reason.WRONG_MODEL), ("kv_mode", Reason.WRONG_KV_MODE),
    ("rotation", Reason.WRONG_ROTATION), ("rank", Reason.WRONG_RANK),
    ("world_size", Reason.WRONG_RANK), ("block_size", Reason.WRONG_LAYOUT),
    ("num_layers", Reason.WRONG_LAYOUT), ("components", Reason.WRONG_LAYOUT),
    ("num_kv_heads", Reason.WRONG_LAYOUT), ("head_dim", Reason.WRONG_LAYOUT),
    ("dtype", Reason.WRONG_LAYOUT), ("scale_dtype", Reason.WRONG_LAYOUT),
    ("fingerprint", Reason.WRONG_FINGERPRINT),
)


def verify(spec: StoreSpec, data: bytes, chain_hash: bytes,
           token_ids: tuple[int, ...]) -> StoredBlock | Rejected:
    """Check a stored block completely against what the reader expects (its own spec, the
    chain hash it looked up and the tokens the block must hold); the block, or why not."""
    header = read_header(data)
    if isinstance(header, Rejected):
        return header
    if header.get("version") != FORMAT_VERSION:
        return Rejected(Reason.WRONG_VERSION, f"version {header.get('version')!r}")
    theirs = header.get("spec")
    if not isinstance(theirs, dict):
        return Rejected(Reason.BAD_HEADER, "no spec")
    n_sums, n_pay, n_sc = spec.nbytes()
    start = header["_body_start"]
    want = start + n_sums + n_pay + n_sc + DIGEST_BYTES
    if len(data) < start + DIGEST_BYTES:
        return Rejected(Reason.SHORT_FILE, f"{len(data)} of {want} bytes")
    digest = hashlib.blake2b(memoryview(data)[: len(data) - DIGEST_BYTES],
                             digest_size=DIGEST_BYTES).digest()
    if digest != data[-DIGEST_BYTES:]:
        if len(data) < want:  # (want is this reader's layout; another's is refused below)
            return Rejected(Reason.SHORT_FILE, f"{len(data)} of {want} bytes")
        return Rejected(Reason.BAD_CHECKSUM)
    mine = asdict(spec)
    for key, reason in _IDENTITY:
        if theirs.get(key) != mine[key]:
            return Rejected(reason, f"{key}: stored {theirs.get(key)!r}, expected {mine[key]!r}")
    if len(data) != want:
        return Rejected(Reason.BAD_HEADER, f"{len(data)} bytes, the layout needs {want}")
    if header.get("chain_hash") != chain_hash.hex():
        return Rejected(Reason.WRONG_BLOCK, "token-chain hash differs")
    if tuple(header.get("token_ids") or ()) != tuple(token_ids):
        return Rejected(Reason.WRONG_TOKENS, "token ids differ")
    body = memoryview(data)[start:]
    sums = np.frombuffer(bytes(body[:n_sums]), dtype="<i8").reshape(spec.num_layers, 4)
    payload = _from_bytes(body[n_sums: n_sums + n_pay], _dtype(spec.dtype), spec.payload_shape)
    scales = None
    if n_sc:
        scales = _from_bytes(body[n_sums + n_pay: n_sums + n_pay + n_sc],
                             _dtype(spec.scale_dtype), spec.scale_shape)
    recomputed = block_sums(payload.unsqueeze(1), None if scales is None else scales.unsqueeze(1))
    if not np.array_equal(recomputed[0], sums):
        return Rejected(Reason.BAD_SUMS, "payload / scales differ from the sealed sums")
    return StoredBlock(chain_hash, tuple(token_ids), payload, scales, sums.astype(np.int64))


def install(kv_cache: PagedKVCache, block_ids: list[int], blocks: list[StoredBlock]) -> None:
    """Copy verified blocks into freshly allocated pool blocks ``block_ids`` (and, where the
    write kernel keeps checksum state, set it to the verified sums so sealing reads them: a
    partial block's unfilled rows are zero, so its later rows add to the state exactly as in
    the engine that sealed it)."""
    dev = kv_cache.data.device
    idx = torch.tensor(block_ids, dtype=torch.int64, device=dev)
    # as bytes: index_copy_ has no FP8 kernel on CPU
    payload = torch.stack([b.payload for b in blocks], 1).to(dev)  # [L, C, n, bs, H, D]
    kv_cache.data.view(torch.uint8).index_copy_(1, idx, payload.view(torch.uint8))
    if kv_cache.scales is not None:
        scales = torch.stack([b.scales for b in blocks], 1).to(dev)  # type: ignore[misc]
        kv_cache.scales.view(torch.uint8).index_copy_(1, idx, scales.view(torch.uint8))
    state = kv_cache.csum_state
    if state is not None:
        sums = torch.from_numpy(np.stack([b.sums for b in blocks], 1)).to(state.device)
        state.index_copy_(1, idx, sums)
