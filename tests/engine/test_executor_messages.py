"""The executor's typed control messages (kvserve/engine/executor_messages.py): every type
round-trips through its wire frame, malformed frames are refused with a clear error, and the
worker has exactly one handler per type, each reaching the part of the rank it names. No
processes are spawned here (tests/distributed/test_executor_wire.py sends them over gloo)."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from kvserve.cache.kv_transfer import TransferHandle
from kvserve.engine import executor
from kvserve.engine import executor_messages as em
from kvserve.engine.step_input import StepInput

H1, H2 = bytes(range(16)), bytes(range(16, 32))


def _step() -> StepInput:
    return StepInput(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 9]),
                     torch.tensor([0, 1, 2, 41]), (3, 1), (3, 10), ((0,), (1, 2)),
                     ((2, 3), (0, 1)), (-1, 0))


def _handle() -> TransferHandle:
    return TransferHandle("abc-123", "dir", "/tmp/x", 40, 3, 4096, 2)


SAMPLES = {
    em.Step: em.Step(_step()),
    em.Seal: em.Seal((3, 4), (1, 2), (H1, H2)),
    em.Verify: em.Verify((3, 4, 9), (1, 2, 0)),
    em.Inject: em.Inject(1, 5, 0, "swap", 2, 7, 3),
    em.DumpKV: em.DumpKV(),
    em.Shutdown: em.Shutdown(),
    em.KVSave: em.KVSave("tiers", (3, 4), (H1, H2), ((1, 2), (3, 4)), msgpack.packb("t-1"),
                         True),
    em.KVLoad: em.KVLoad("transfer", (7, 8), (H2, H1), ((4,), (5, 6)),
                         msgpack.packb(_handle().to_dict())),
}


def _roundtrip(msg):
    f = em.encode_message(msg)
    return em.decode_message(f.header, f.spill, f.body)


def _same(a, b) -> bool:
    """Field-wise equality (tensors compared by value)."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(em.MESSAGE_TYPES)
    assert len(em.MESSAGE_TYPES) == len({t.__name__ for t in em.MESSAGE_TYPES})


@pytest.mark.parametrize("kind", em.MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_every_message_type_round_trips(kind):
    msg = SAMPLES[kind]
    back = _roundtrip(msg)
    assert _same(back, msg), (back, msg)
    assert not _same(back, SAMPLES[em.Verify] if kind is not em.Verify else SAMPLES[em.Seal])


def test_the_step_is_the_tensor_body_and_the_envelope_stays_in_the_header():
    step = _step()
    f = em.encode_message(em.Step(step))
    assert f.spill is None and f.header.numel() == em.HEADER_WORDS
    assert torch.equal(f.body, step.to_tensor())
    assert em.frame_sizes(f.header) == (0, step.to_tensor().numel())


def test_a_long_message_spills_its_envelope():
    n = 300
    msg = em.Seal(tuple(range(n)), tuple(range(n)), tuple(bytes([i % 256]) * 16 for i in range(n)))
    f = em.encode_message(msg)
    assert f.spill is not None and f.body is None
    assert em.frame_sizes(f.header)[0] == f.spill.numel()
    assert _same(_roundtrip(msg), msg)
    assert em.encode_message(em.Verify((1,), (2,))).spill is None  # short ones: the header alone


def _frame(envelope: object, body: torch.Tensor | None = None) -> em.Frame:
    """A frame around a hand-made envelope (what a foreign or broken sender might send)."""
    raw = msgpack.packb(envelope)
    header = np.zeros(em.HEADER_WORDS, dtype=np.int64)
    header[0], header[1] = len(raw), 0 if body is None else body.numel()
    header.view(np.uint8)[16: 16 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return em.Frame(torch.from_numpy(header), None, body)


def _decode(envelope: object, body: torch.Tensor | None = None):
    f = _frame(envelope, body)
    return em.decode_message(f.header, f.spill, f.body)


def test_a_hand_made_frame_decodes():
    """The frame helper above builds real frames: the rejections below are about content."""
    fields = {"block_ids": [1], "generations": [2]}
    assert _decode([em.PROTOCOL_VERSION, "verify", fields]) == em.Verify((1,), (2,))


def test_wrong_version_is_refused():
    with pytest.raises(em.MessageError, match="protocol version 2; this rank speaks version 1"):
        _decode([2, "verify", {"block_ids": [1], "generations": [2]}])
    with pytest.raises(em.MessageError, match="protocol version True"):
        _decode([True, "verify", {"block_ids": [1], "generations": [2]}])  # True == 1


def test_unknown_type_is_refused():
    with pytest.raises(em.MessageError, match="unknown executor message type 'reboot'.*seal"):
        _decode([em.PROTOCOL_VERSION, "reboot", {}])
    with pytest.raises(em.MessageError, match="unknown executor message type 3"):
        _decode([em.PROTOCOL_VERSION, 3, {}])  # the old integer kinds are not tags


@pytest.mark.parametrize("tag,fields,match", [
    ("verify", {"block_ids": ["1"], "generations": [2]}, "block_ids items must be int, got str"),
    ("verify", {"block_ids": 1, "generations": [2]}, "block_ids must be a list, got int"),
    ("verify", {"block_ids": [True], "generations": [2]}, "items must be int, got bool"),
    ("verify", {"block_ids": [1]}, r"missing fields \['generations'\]"),
    ("verify", {"block_ids": [1], "generations": [2], "x": 1}, r"unexpected fields \['x'\]"),
    ("verify", {"block_ids": [1, 2], "generations": [2]}, "equal lengths"),
    ("seal", {"block_ids": [1], "generations": [1], "token_hashes": ["ab"]},
     "token_hashes items must be bytes, got str"),
    ("inject", {"rank": 1, "block_id": 2, "layer": 0, "kind": 3, "index": 0, "bit": 0,
                "other_index": 1}, "field kind must be str, got int"),
    ("inject", {"rank": 1.0, "block_id": 2, "layer": 0, "kind": "swap", "index": 0, "bit": 0,
                "other_index": 1}, "field rank must be int, got float"),
    ("kv_save", {"connector": "tiers", "block_ids": [1], "chain_hashes": [H1],
                 "token_ids": [[1, "2"]], "arg": b"\xc0", "wait": False},
     r"token_ids\[0\] items must be int"),
    ("kv_save", {"connector": "tiers", "block_ids": [1], "chain_hashes": [H1],
                 "token_ids": [[1]], "arg": b"\xc0", "wait": 0},
     "field wait must be bool, got int"),
    ("kv_load", {"connector": 1, "block_ids": [], "chain_hashes": [], "token_ids": [],
                 "arg": b"\xc0"}, "field connector must be str, got int"),
    ("kv_load", {"connector": "transfer", "block_ids": [], "chain_hashes": [],
                 "token_ids": [], "arg": "x"}, "field arg must be bytes, got str"),
    ("verify", [1, 2], "fields must be a map"),
])
def test_malformed_fields_are_refused(tag, fields, match):
    with pytest.raises(em.MessageError, match=match):
        _decode([em.PROTOCOL_VERSION, tag, fields])


def test_malformed_envelopes_and_bodies_are_refused():
    with pytest.raises(em.MessageError, match=r"must be \[version, type, fields\]"):
        _decode({"v": 1})
    with pytest.raises(em.MessageError, match=r"must be \[version, type, fields\]"):
        _decode([em.PROTOCOL_VERSION, "shutdown"])
    # an extension type (what a pickle-style sender might smuggle) is not a field value
    with pytest.raises(em.MessageError, match="field arg must be bytes, got ExtType"):
        _decode([em.PROTOCOL_VERSION, "kv_load",
                 {"connector": "transfer", "arg": msgpack.ExtType(1, b"x"), "block_ids": [],
                  "chain_hashes": [], "token_ids": []}])
    with pytest.raises(em.MessageError, match="carries no tensor, got 3 words"):
        _decode([em.PROTOCOL_VERSION, "shutdown", {}], torch.zeros(3, dtype=torch.int64))
    with pytest.raises(em.MessageError, match="field step: malformed step input"):
        _decode([em.PROTOCOL_VERSION, "step", {}], torch.tensor([4, 1, 0, 0, 0, 0, 1]))
    with pytest.raises(em.MessageError, match="field step: malformed step input"):
        _decode([em.PROTOCOL_VERSION, "step", {}])  # no body at all
    garbage = torch.zeros(em.HEADER_WORDS, dtype=torch.int64)
    garbage[0] = 5
    garbage.numpy().view(np.uint8)[16:21] = np.frombuffer(b"\xc1\xc1\xc1\xc1\xc1", np.uint8)
    with pytest.raises(em.MessageError, match="envelope is not msgpack"):
        em.decode_message(garbage)


def test_header_sizes_out_of_range_are_refused():
    h = em.encode_message(em.Shutdown()).header.clone()
    for env, body in ((0, 0), (-1, 0), (em.MAX_ENVELOPE_BYTES + 1, 0), (5, -2)):
        h[0], h[1] = env, body
        with pytest.raises(em.MessageError, match="header sizes out of range"):
            em.frame_sizes(h)
    with pytest.raises(em.MessageError, match=r"header must be int64\[32\]"):
        em.frame_sizes(torch.zeros(2, dtype=torch.int64))
    f = em.encode_message(em.Seal(tuple(range(99)), tuple(range(99)), (H1,) * 99))
    with pytest.raises(em.MessageError, match="envelope of .* bytes missing"):
        em.decode_message(f.header)


def test_only_registered_messages_are_sent():
    @dataclasses.dataclass(frozen=True, slots=True)
    class Reboot:
        pass

    with pytest.raises(em.MessageError, match="Reboot is not a registered executor message"):
        em.encode_message(Reboot())


def test_a_tag_cannot_be_registered_twice():
    with pytest.raises(AssertionError, match="registered twice"):
        em.message("seal")(type("Again", (), {}))


# ---- the worker's dispatch ------------------------------------------------------------------
def test_every_message_type_has_exactly_one_handler():
    assert set(executor.HANDLERS) == set(em.MESSAGE_TYPES)
    assert len(set(executor.HANDLERS.values())) == len(executor.HANDLERS)


class _Rank:
    """Stands for a worker rank's worker, seals and KV connectors: records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.rank, self.replica_key, self.kv_cache = 1, None, "kv"

    def __getattr__(self, name: str):
        def record(*args, **kw):
            self.calls.append((name, args, kw))
            if name == "verify":  # every other block bad
                return [i % 2 == 1 for i in range(len(args[0]))]
            return {"save_slice": 11, "load_slice": ([0, 2], 22)}.get(name)
        return record


# what each message must reach on the rank, and the collective that answers rank 0
EXPECTED = {
    em.Step: ("execute", None),
    em.Seal: ("seal", None),  # no replicated KV on this rank: no gather
    em.Verify: ("verify", "all_reduce"),
    em.Inject: ("inject_fault", None),
    em.DumpKV: ("kv_bytes", "gather"),
    em.Shutdown: ("close", None),
    em.KVSave: ("save_slice", "gather"),
    em.KVLoad: ("load_slice", "gather"),
}


@pytest.fixture
def rank(monkeypatch):
    r = _Rank()
    monkeypatch.setattr(executor.ps, "cpu_gather", lambda x: r.calls.append(("gather", x)))
    monkeypatch.setattr(executor.ps, "cpu_all_reduce_max",
                        lambda x: r.calls.append(("all_reduce", x)) or x)
    monkeypatch.setattr(executor, "inject_fault", lambda *a, **kw: r.calls.append(
        ("inject_fault", a, kw)))
    monkeypatch.setattr(executor, "kv_bytes", lambda w: r.calls.append(("kv_bytes",)))
    return r


@pytest.mark.parametrize("kind", em.MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_each_handler_reaches_its_part_of_the_rank(rank, kind):
    assert set(EXPECTED) == set(em.MESSAGE_TYPES)
    state = executor.WorkerRank(rank, rank, {"tiers": rank, "transfer": rank})
    stop = executor.dispatch(state, _roundtrip(SAMPLES[kind]))
    assert stop is (kind is em.Shutdown)
    call, collective = EXPECTED[kind]
    names = [c[0] for c in rank.calls]
    assert call in names, names
    assert (collective in names) if collective else not {"gather", "all_reduce"} & set(names)


def test_handlers_pass_the_fields_through(rank):
    state = executor.WorkerRank(rank, rank, {"tiers": rank, "transfer": rank})
    executor.dispatch(state, SAMPLES[em.KVSave])
    name, (refs, arg, wait), _ = rank.calls[-2]
    assert name == "save_slice" and arg == "t-1" and wait is True
    assert [(r.block_id, r.chain_hash, r.token_ids) for r in refs] == \
        [(3, H1, (1, 2)), (4, H2, (3, 4))]
    assert torch.equal(rank.calls[-1][1], torch.tensor([11]))
    executor.dispatch(state, SAMPLES[em.Inject])
    assert rank.calls[-1] == ("inject_fault", ("kv", 5, 0, "swap"),
                              {"index": 2, "bit": 7, "other_index": 3})
    rank.calls.clear()
    executor.dispatch(state, em.Inject(2, 5, 0, "swap", 0, 0, 1))  # another rank's fault
    assert rank.calls == []
    executor.dispatch(state, SAMPLES[em.Verify])  # blocks 3, 4, 9; the fake flags the 2nd
    assert [c[0] for c in rank.calls] == ["verify", "all_reduce", "drop"]
    assert rank.calls[-1][1] == ([4],)
    rank.calls.clear()
    executor.dispatch(state, SAMPLES[em.KVLoad])
    name, (refs, handle), _ = rank.calls[0]
    assert name == "load_slice" and TransferHandle.from_dict(handle) == _handle()
    assert [(r.block_id, r.chain_hash, r.token_ids) for r in refs] == \
        [(7, H2, (4,)), (8, H1, (5, 6))]
    assert torch.equal(rank.calls[1][1], torch.tensor([22, 0, 2]))


def test_a_rank_without_the_connector_refuses_its_messages(rank):
    state = executor.WorkerRank(rank, rank, {"tiers": rank})
    with pytest.raises(em.MessageError, match="KVLoad for KV connector 'transfer', which this "
                                              "rank lacks"):
        executor.dispatch(state, SAMPLES[em.KVLoad])
    assert executor.dispatch(state, em.Shutdown()) is True
