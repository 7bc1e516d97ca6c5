"""The executor's messages over the real transport: rank 0 ``_send``s every message type (and
one long enough to spill its envelope) over gloo at world size 2, rank 1 ``_recv``s them; each
arrives as the same typed message (its re-encoded frame is identical)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_world

# slow: spawns tensor-parallel rank processes
pytestmark = pytest.mark.slow


def _messages() -> list:
    from kvserve.engine import executor_messages as em
    from tests.engine.test_executor_messages import SAMPLES

    long = em.Seal(tuple(range(200)), tuple(range(200)), (bytes(16),) * 200)
    return [SAMPLES[t] for t in em.MESSAGE_TYPES] + [long]


def _frames(msg) -> list:
    from kvserve.engine import executor_messages as em

    f = em.encode_message(msg)
    return [type(msg).__name__, f.header, f.spill, f.body]


def _exchange(rank: int, world: int) -> list:
    from kvserve.engine import executor

    if rank == 0:
        sent = _messages()
        for m in sent:
            executor._send(m)
        return [_frames(m) for m in sent]
    return [_frames(executor._recv()) for _ in _messages()]


def test_every_message_crosses_ranks_typed(tmp_path):
    import torch

    sent, received = run_world(_exchange, 2, tmp_path)
    assert len(received) == len(sent) == 9  # 8 types and the long one
    for a, b in zip(sent, received, strict=True):
        assert a[0] == b[0]
        for x, y in zip(a[1:], b[1:], strict=True):
            assert (x is None and y is None) or torch.equal(x, y), a[0]
    assert sent[-1][2] is not None  # the long one spilled
