"""The executor's control messages: what the driver (rank 0) tells the worker ranks.

Each message is a frozen, slotted dataclass registered under a type tag (``@message("tag")``);
``MESSAGE_TYPES`` lists them all and the worker has exactly one handler per type
(``executor.HANDLERS``, checked by a test). On the wire (``encode_message`` /
``decode_message``) a message is one msgpack envelope ``[PROTOCOL_VERSION, tag, {field:
value}]`` plus at most one int64 tensor ``body`` for a field whose type serializes itself as a
tensor (``StepInput``: a step's token ids stay a tensor, no per-token msgpack). Everything
travels as int64 tensors, in this order:

    header int64[HEADER_WORDS] = (envelope bytes, body words, the envelope inline when it
           fits in the remaining (HEADER_WORDS - 2) * 8 bytes, zero-padded)
    spill  int64[ceil(envelope bytes / 8)]  the envelope, only when it does not fit inline
    body   int64[body words]                only when body words > 0

so the hot decode step (``Step``: envelope inline, the ``StepInput`` as body) costs the same
two broadcasts as the integer-kind protocol before it. Field types allowed: int, bool, str,
bytes, tuple[X, ...] of those, a class with ``to_dict`` / ``from_dict`` (carried in the
envelope) and one class with ``to_tensor`` / ``from_tensor`` (the body). ``decode_message``
checks the version, the tag, the field names and every value's type before building the
message, and raises ``MessageError`` naming what is wrong. No pickle: msgpack carries only
plain values.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, fields

import msgpack
import numpy as np
import torch

from kvserve.engine.step_input import StepInput

PROTOCOL_VERSION = 1
HEADER_WORDS = 32  # 256 bytes: small control messages travel in the header alone
_INLINE_BYTES = (HEADER_WORDS - 2) * 8
MAX_ENVELOPE_BYTES = 1 << 30  # a size beyond this in a header is garbage, not a message


class MessageError(ValueError):
    """A malformed executor message: wrong version, unknown type, bad or missing fields."""


# ---- field codecs ------------------------------------------------------------------------------
# A codec checks one decoded msgpack value and returns the field's value (tuples for lists).
_Check = Callable[[object, str], object]


def _scalar(kind: type) -> _Check:
    def check(v: object, where: str) -> object:
        # exact types: a bool is not an int here, and msgpack yields plain int / str / bytes
        if type(v) is not kind:
            raise MessageError(f"{where} must be {kind.__name__}, got {type(v).__name__}")
        return v
    return check


def _sequence(item: _Check, item_type: object) -> _Check:
    def check(v: object, where: str) -> object:
        if not isinstance(v, list):
            raise MessageError(f"{where} must be a list, got {type(v).__name__}")
        if item_type in (int, bytes, str):  # the common case, without a call per item
            if not all(type(x) is item_type for x in v):
                bad = next(x for x in v if type(x) is not item_type)
                raise MessageError(f"{where} items must be {item_type.__name__}, got "
                                   f"{type(bad).__name__}")
            return tuple(v)
        return tuple(item(x, f"{where}[{i}]") for i, x in enumerate(v))
    return check


def _from_dict(cls: type) -> _Check:
    def check(v: object, where: str) -> object:
        try:
            return cls.from_dict(v)
        except ValueError as e:
            raise MessageError(f"{where}: {e}") from e
    return check


def _codec(tp: object, where: str) -> _Check:
    if tp in (int, bool, str, bytes):
        return _scalar(tp)  # type: ignore[arg-type]
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence(_codec(args[0], where), args[0])
    if isinstance(tp, type) and hasattr(tp, "from_dict") and hasattr(tp, "to_dict"):
        return _from_dict(tp)
    raise TypeError(f"{where}: field type {tp!r} has no wire form")


@dataclass(frozen=True, slots=True)
class _Schema:
    tag: str
    cls: type
    envelope: tuple[tuple[str, _Check, bool], ...]  # (name, codec, carried by to_dict)
    body: str | None  # the field carried as the tensor body
    body_type: type | None  # its class (``to_tensor`` / ``from_tensor``)


_BY_TAG: dict[str, _Schema] = {}
_BY_TYPE: dict[type, _Schema] = {}


def message(tag: str):
    """Register a message dataclass under ``tag`` (its fields' types define the wire form)."""
    def register(cls: type) -> type:
        assert tag not in _BY_TAG, f"message tag {tag!r} registered twice"
        hints = typing.get_type_hints(cls)
        envelope, body, body_type = [], None, None
        for f in fields(cls):
            tp = hints[f.name]
            if isinstance(tp, type) and hasattr(tp, "from_tensor"):
                assert body is None, f"{cls.__name__}: at most one tensor field"
                body, body_type = f.name, tp
                continue
            envelope.append((f.name, _codec(tp, f"{cls.__name__}.{f.name}"),
                             isinstance(tp, type) and hasattr(tp, "to_dict")))
        schema = _Schema(tag, cls, tuple(envelope), body, body_type)
        _BY_TAG[tag] = _BY_TYPE[cls] = schema
        return cls
    return register


def _same_length(msg: object, *names: str) -> None:
    lengths = {n: len(getattr(msg, n)) for n in names}
    if len(set(lengths.values())) > 1:
        raise MessageError(f"{type(msg).__name__}: fields must have equal lengths, got {lengths}")


# ---- the messages (all rank 0 -> every rank) -------------------------------------------------
@message("step")
@dataclass(frozen=True, slots=True)
class Step:
    """Run one forward (every rank; rank 0 samples after the logits gather)."""

    step: StepInput


@message("seal")
@dataclass(frozen=True, slots=True)
class Seal:
    """Seal each rank's slice of the blocks; with replicated KV, then a gather to rank 0 of
    (replica key, content hash per block), compared there (``executor.replica_mismatch``)."""

    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    token_hashes: tuple[bytes, ...]  # 16 bytes each

    def __post_init__(self) -> None:
        _same_length(self, "block_ids", "generations", "token_hashes")


@message("verify")
@dataclass(frozen=True, slots=True)
class Verify:
    """Verify each rank's slice, then all_reduce(MAX) of the bad mask [n]."""

    block_ids: tuple[int, ...]
    generations: tuple[int, ...]

    def __post_init__(self) -> None:
        _same_length(self, "block_ids", "generations")


@message("inject")
@dataclass(frozen=True, slots=True)
class Inject:
    """Corrupt one block's bytes on rank ``rank`` only (drills, tests)."""

    rank: int
    block_id: int
    layer: int
    kind: str  # "bitflip" / "scale" / "swap"
    index: int
    bit: int
    other_index: int


@message("dump_kv")
@dataclass(frozen=True, slots=True)
class DumpKV:
    """A gather of every rank's KV bytes to rank 0 (tests: ``engine.debug.gather_kv``)."""


@message("shutdown")
@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the KV connectors (the tiers write down first), leave the loop (exit 0)."""


@message("kv_save")
@dataclass(frozen=True, slots=True)
class KVSave:
    """Each rank's KV connector ``connector`` saves its slice of the blocks now, before the
    next step overwrites them (``KVConnector.save_slice``: the tiers queue evicted blocks, the
    PD transfer offers a prompt's), then a gather to rank 0 of each rank's bytes (a PD handle
    is issued only after every slice is offered). ``arg``: the connector's argument as
    msgpack (the transfer id, or nil); ``wait``: do not drop (shutdown)."""

    connector: str
    block_ids: tuple[int, ...]
    chain_hashes: tuple[bytes, ...]
    token_ids: tuple[tuple[int, ...], ...]
    arg: bytes
    wait: bool

    def __post_init__(self) -> None:
        _same_length(self, "block_ids", "chain_hashes", "token_ids")


@message("kv_load")
@dataclass(frozen=True, slots=True)
class KVLoad:
    """Each rank's KV connector ``connector`` loads, verifies and installs its slice of the
    blocks (``KVConnector.load_slice``), then a gather to rank 0 of (bytes, a ``PEER_REASONS``
    code per block). ``arg``: the connector's argument as msgpack (a PD handle, or nil)."""

    connector: str
    block_ids: tuple[int, ...]
    chain_hashes: tuple[bytes, ...]
    token_ids: tuple[tuple[int, ...], ...]
    arg: bytes

    def __post_init__(self) -> None:
        _same_length(self, "block_ids", "chain_hashes", "token_ids")


Message = Step | Seal | Verify | Inject | DumpKV | Shutdown | KVSave | KVLoad
MESSAGE_TYPES: tuple[type, ...] = tuple(s.cls for s in _BY_TAG.values())
assert set(MESSAGE_TYPES) == set(typing.get_args(Message)), "Message and the registry differ"


# ---- the wire ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Frame:
    """One message as the tensors that cross ranks, in order (see the module docstring)."""

    header: torch.Tensor  # int64[HEADER_WORDS]
    spill: torch.Tensor | None  # int64: the envelope, when too long for the header
    body: torch.Tensor | None  # int64: the tensor field


def encode_message(msg: Message) -> Frame:
    schema = _BY_TYPE.get(type(msg))
    if schema is None:
        raise MessageError(f"{type(msg).__name__} is not a registered executor message")
    values = {name: getattr(msg, name).to_dict() if as_dict else getattr(msg, name)
              for name, _, as_dict in schema.envelope}
    env = msgpack.packb([PROTOCOL_VERSION, schema.tag, values])
    body = None
    if schema.body is not None:
        body = getattr(msg, schema.body).to_tensor()
        if body.dtype != torch.int64 or not body.is_contiguous():
            body = body.to(torch.int64).contiguous()
    header = np.zeros(HEADER_WORDS, dtype=np.int64)
    header[0], header[1] = len(env), 0 if body is None else body.numel()
    spill = None
    if len(env) <= _INLINE_BYTES:
        header.view(np.uint8)[16 : 16 + len(env)] = np.frombuffer(env, dtype=np.uint8)
    else:
        padded = env + b"\0" * (-len(env) % 8)
        spill = torch.from_numpy(np.frombuffer(padded, dtype=np.int64).copy())
    return Frame(torch.from_numpy(header), spill, body)


def frame_sizes(header: torch.Tensor) -> tuple[int, int]:
    """(spill words, body words) that follow this header; MessageError if it is garbage."""
    if header.dtype != torch.int64 or header.numel() != HEADER_WORDS:
        raise MessageError(f"executor message header must be int64[{HEADER_WORDS}]")
    n_env, n_body = header.numpy()[:2].tolist()
    if not 0 < n_env <= MAX_ENVELOPE_BYTES or not 0 <= n_body <= MAX_ENVELOPE_BYTES:
        raise MessageError(f"executor message header sizes out of range: envelope {n_env} "
                           f"bytes, body {n_body} words")
    return (0 if n_env <= _INLINE_BYTES else -(-n_env // 8)), n_body


def decode_message(header: torch.Tensor, spill: torch.Tensor | None = None,
           body: torch.Tensor | None = None) -> Message:
    """The message a frame carries, every field checked (``MessageError`` otherwise)."""
    n_spill, n_body = frame_sizes(header)
    n_env = int(header.numpy()[0])
    if n_spill:
        if spill is None or spill.numel() != n_spill:
            raise MessageError(f"executor message: envelope of {n_env} bytes missing")
        raw = spill.numpy().tobytes()[:n_env]
    else:
        raw = header.numpy()[2:].tobytes()[:n_env]
    try:
        env = msgpack.unpackb(raw)
    except Exception as e:  # msgpack raises several types for garbage  # noqa: BLE001
        raise MessageError(f"executor message: envelope is not msgpack ({e})") from e
    if not isinstance(env, list) or len(env) != 3:
        raise MessageError("executor message: envelope must be [version, type, fields]")
    version, tag, values = env
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise MessageError(f"executor message protocol version {version!r}; this rank speaks "
                           f"version {PROTOCOL_VERSION} (mixed kvserve builds?)")
    schema = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if schema is None:
        raise MessageError(f"unknown executor message type {tag!r} (known: "
                           f"{', '.join(sorted(_BY_TAG))})")
    if not isinstance(values, dict):
        raise MessageError(f"executor message {tag!r}: fields must be a map")
    names = {name for name, _, _ in schema.envelope}
    if set(values) != names:
        missing, extra = sorted(names - set(values)), sorted(set(values) - names, key=str)
        raise MessageError(f"executor message {tag!r}: missing fields {missing}, unexpected "
                           f"fields {extra}")
    kw = {name: check(values[name], f"executor message {tag!r} field {name}")
          for name, check, _ in schema.envelope}
    if schema.body is not None:
        tensor = body if body is not None else torch.empty(0, dtype=torch.int64)
        if tensor.numel() != n_body:
            raise MessageError(f"executor message {tag!r}: body of {n_body} words missing")
        try:
            kw[schema.body] = schema.body_type.from_tensor(tensor)
        except ValueError as e:
            raise MessageError(f"executor message {tag!r} field {schema.body}: {e}") from e
    elif n_body:
        raise MessageError(f"executor message {tag!r} carries no tensor, got {n_body} words")
    return schema.cls(**kw)
