"""The stored-block format (kvserve/cache/block_store.py): a round trip is bit exact, and every
kind of damage or foreign identity is refused with its own reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvserve.cache import block_store as bs
from kvserve.cache.block_store import Reason, Rejected, StoredBlock, StoreSpec

SPECS = {
    "int8": ("int8", "int8", "hadamard:16:seed=0", torch.int8, torch.int8),
    "fp8": ("fp8_e4m3", "float8_e4m3fn", "", torch.float8_e4m3fn, torch.bfloat16),
    "bf16": ("bf16", "bfloat16", "", torch.bfloat16, None),
}


def _spec(kind: str, components: int = 2) -> StoreSpec:
    mode, dtype, rot, _, sdt = SPECS[kind]
    return StoreSpec(model="ab" * 16, kv_mode=mode, rotation=rot, fingerprint="cd" * 16,
                     block_size=4, num_layers=3, components=components, num_kv_heads=2,
                     head_dim=16, dtype=dtype, scale_dtype="" if sdt is None else
                     bs.dtype_str(sdt))


def _block(spec: StoreSpec, seed: int = 0) -> StoredBlock:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(spec.payload_shape)) * 2,), generator=g,
                        dtype=torch.uint8)
    dt = bs._dtype(spec.dtype)
    payload = raw[: int(np.prod(spec.payload_shape)) * dt.itemsize].view(dt).reshape(
        spec.payload_shape)
    if dt.is_floating_point:  # finite values only (NaN payloads are legal but noisy to print)
        payload = torch.randn(spec.payload_shape, generator=g).to(dt)
    scales = None
    if spec.scale_dtype:
        sdt = bs._dtype(spec.scale_dtype)
        scales = (torch.randint(-60, 60, spec.scale_shape, generator=g).to(sdt)
                  if sdt == torch.int8 else torch.rand(spec.scale_shape, generator=g).to(sdt))
    sums = bs.block_sums(payload.unsqueeze(1), None if scales is None else scales.unsqueeze(1))
    toks = tuple(range(100 + seed, 100 + seed + spec.block_size))
    return StoredBlock(bytes([seed]) * 16, toks, payload, scales, sums[0])


def _flip(blob: bytes, offset: int, bit: int = 0) -> bytes:
    b = bytearray(blob)
    b[offset] ^= 1 << bit
    return bytes(b)


def _sections(blob: bytes, spec: StoreSpec) -> tuple[int, int, int]:
    """Offsets of the sums, payload and scales sections."""
    start = bs.read_header(blob)["_body_start"]
    n_sums, n_pay, _ = spec.nbytes()
    return start, start + n_sums, start + n_sums + n_pay


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("components", [2, 1])
def test_round_trip_is_bit_exact(kind, components):
    spec = _spec(kind, components)
    blk = _block(spec)
    blob = bs.serialize(spec, blk)
    out = bs.verify(spec, blob, blk.chain_hash, blk.token_ids)
    assert isinstance(out, StoredBlock), out
    assert torch.equal(out.payload.view(torch.uint8), blk.payload.view(torch.uint8))
    if blk.scales is None:
        assert out.scales is None
    else:
        assert torch.equal(out.scales.view(torch.uint8), blk.scales.view(torch.uint8))
    assert np.array_equal(out.sums, blk.sums)
    assert out.token_ids == blk.token_ids


def _reason(spec, blob, blk) -> Reason:
    out = bs.verify(spec, blob, blk.chain_hash, blk.token_ids)
    assert isinstance(out, Rejected), "damaged block accepted"
    return out.reason


@pytest.mark.parametrize("bit", [0, 3, 7])
def test_flipped_bits_are_refused(bit):
    spec = _spec("int8")
    blk = _block(spec)
    blob = bs.serialize(spec, blk)
    s, p, c = _sections(blob, spec)
    for where in (s + 5, p + 17, c + 3, len(blob) - 1, 20):  # sums, payload, scale, digest, hdr
        r = _reason(spec, _flip(blob, where, bit), blk)
        assert r in (Reason.BAD_CHECKSUM, Reason.BAD_HEADER), (where, r)
    assert _reason(spec, _flip(blob, p + 17, bit), blk) == Reason.BAD_CHECKSUM
    assert _reason(spec, _flip(blob, c + 3, bit), blk) == Reason.BAD_CHECKSUM
    assert _reason(spec, _flip(blob, s + 5, bit), blk) == Reason.BAD_CHECKSUM


def test_truncated_and_garbage():
    spec = _spec("fp8")
    blk = _block(spec)
    blob = bs.serialize(spec, blk)
    for n in (0, 5, 30, len(blob) // 2, len(blob) - 1):
        assert _reason(spec, blob[:n], blk) == Reason.SHORT_FILE, n
    assert _reason(spec, b"x" * 200, blk) == Reason.BAD_HEADER
    assert _reason(spec, blob + b"\0", blk) == Reason.BAD_CHECKSUM


@pytest.mark.parametrize("field,value,reason", [
    ("model", "00" * 16, Reason.WRONG_MODEL),
    ("kv_mode", "int8_plain", Reason.WRONG_KV_MODE),
    ("rotation", "hadamard:16:seed=1", Reason.WRONG_ROTATION),
    ("rank", 1, Reason.WRONG_RANK),
    ("world_size", 2, Reason.WRONG_RANK),
    ("block_size", 8, Reason.WRONG_LAYOUT),
    ("num_kv_heads", 1, Reason.WRONG_LAYOUT),
    ("fingerprint", "ee" * 16, Reason.WRONG_FINGERPRINT),
])
def test_foreign_identity_is_refused(field, value, reason):
    spec = _spec("int8")
    theirs = dataclasses.replace(spec, **{field: value})
    blk = _block(theirs)
    blob = bs.serialize(theirs, blk)
    assert _reason(spec, blob, blk) == reason
    assert isinstance(bs.verify(theirs, blob, blk.chain_hash, blk.token_ids), StoredBlock)


def test_other_version_block_and_tokens(monkeypatch):
    spec = _spec("bf16")
    blk = _block(spec)
    blob = bs.serialize(spec, blk)
    other = _block(spec, seed=1)
    assert _reason(spec, blob, other) == Reason.WRONG_BLOCK  # another entry's file
    same_hash = dataclasses.replace(other, chain_hash=blk.chain_hash)
    assert _reason(spec, blob, same_hash) == Reason.WRONG_TOKENS  # a hash collision
    monkeypatch.setattr(bs, "FORMAT_VERSION", 0)
    old = bs.serialize(spec, blk)
    monkeypatch.undo()
    assert _reason(spec, old, blk) == Reason.WRONG_VERSION


def test_consistent_file_with_wrong_sums_is_refused():
    """A file whose digest holds but whose payload is not what was sealed (a writer bug)."""
    spec = _spec("int8")
    blk = _block(spec)
    sums = blk.sums.copy()
    sums[1, 0] += 1
    blob = bs.serialize(spec, dataclasses.replace(blk, sums=sums))
    assert _reason(spec, blob, blk) == Reason.BAD_SUMS


def test_serialize_rejects_mismatched_block():
    spec = _spec("int8")
    blk = _block(spec)
    with pytest.raises(ValueError, match="payload shape"):
        bs.serialize(dataclasses.replace(spec, num_layers=2), blk)
    with pytest.raises(ValueError, match="tokens"):
        bs.serialize(spec, dataclasses.replace(blk, token_ids=(1,) * (spec.block_size + 1)))
    with pytest.raises(ValueError, match="tokens"):
        bs.serialize(spec, dataclasses.replace(blk, token_ids=()))
    # a partly filled block (a prompt's last, kv_transfer.py) is a block
    assert bs.serialize(spec, dataclasses.replace(blk, token_ids=(1, 2)))
