"""A third-party KV connector (docs/kv-connector.md) loaded by ``--kv-connector module:Class``:
``SharedStore`` keeps finished requests' prompt blocks in one dict shared by every engine of
this process, so a second engine gets the first one's prompt blocks from it, verified, with
the output of a cold engine; bad values of the flag are ValueErrors naming it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvserve import LLM
from kvserve.cache.block_store import Rejected
from kvserve.cache.kv_connector import BlockRef, KVConnector, Load, load_connector
from kvserve.engine.arg_utils import EngineArgs
from tests.cache.test_kv_tiers import _llm, _outs, _prompts

STORE: dict[str, bytes] = {}  # shared by every SharedStore of this process
_LOCK = threading.Lock()
CONNECTOR = "tests.cache.test_kv_connector:SharedStore"


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    from tests.conftest import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("llama_bf16")), "llama",
                           save_dtype=torch.bfloat16)


class SharedStore(KVConnector):
    """Full prompt blocks of finished requests, by model fingerprint and chain hash."""

    name = "shared"
    saves_finished = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.saved = self.loaded = self.refused = 0

    def _key(self, r: BlockRef) -> str:
        return f"{self.spec.fingerprint}/{r.chain_hash.hex()}"

    def request_finished(self, refs: list[BlockRef], sums: list[np.ndarray | None],
                         export: bool) -> dict | None:
        new = [(r, s) for r, s in zip(refs, sums, strict=True)
               if len(r.token_ids) == self.spec.block_size and self._key(r) not in STORE]
        if new:
            blobs = self.save_blobs([r for r, _ in new], [s for _, s in new])
            with _LOCK:
                STORE.update((self._key(r), b) for (r, _), b in zip(new, blobs, strict=True))
            self.saved += len(new)
        return None

    def num_loadable(self, refs: list[BlockRef], handle: dict | None) -> int:
        n = 0
        while handle is None and n < len(refs) and self._key(refs[n]) in STORE:
            n += 1
        return n

    def load(self, job: Load) -> None:
        for r in job.refs:
            res = self.verify(STORE[self._key(r)], r)
            if isinstance(res, Rejected):
                self.refused += 1
                return
            job.blocks.append(res)
            self.loaded += 1


def test_second_engine_loads_the_first_ones_prompt_blocks(tiny_bf16):
    STORE.clear()
    prompts = _prompts(3)
    cold = _llm(tiny_bf16, "int8")
    first = _llm(tiny_bf16, "int8", kv_connector=CONNECTOR)
    second = _llm(tiny_bf16, "int8", kv_connector=CONNECTOR)
    try:
        ref = _outs(cold, prompts)
        assert _outs(first, prompts) == ref
        saver = first.engine.kv_manager.connectors["shared"]
        assert saver.saved == len(STORE) > 0 and saver.loaded == 0
        assert _outs(second, prompts) == ref  # identical, from the first engine's blocks
        loader = second.engine.kv_manager.connectors["shared"]
        assert loader.loaded > 0 and loader.refused == 0
        assert second.engine.kv_manager.num_restored_tokens > 0
        second.engine.debug.check_no_leaks()
        # a damaged value is refused by block_store.verify: recomputed, same output
        key = next(iter(STORE))
        blob = bytearray(STORE[key])
        blob[len(blob) // 2] ^= 0x01
        STORE[key] = bytes(blob)
        third = _llm(tiny_bf16, "int8", kv_connector=CONNECTOR)
        try:
            assert _outs(third, prompts) == ref
            assert third.engine.kv_manager.connectors["shared"].refused > 0
        finally:
            third.engine.shutdown()
    finally:
        for llm in (cold, first, second):
            llm.engine.shutdown()
        STORE.clear()


@pytest.mark.parametrize("value", ["nocolon", "a:b:c", ":Cls", "mod:"])
def test_malformed_value_names_the_parameter(value):
    with pytest.raises(ValueError, match="kv_connector"):
        EngineArgs(kv_connector=value).cache_config()


@pytest.mark.parametrize("value", ["kvserve_no_such_module:X", "json:NoSuchClass",
                                   "json:JSONDecoder"])
def test_unloadable_class_names_the_parameter(value):
    with pytest.raises(ValueError, match="kv_connector"):
        load_connector(value)


def test_loads_a_subclass():
    assert load_connector(CONNECTOR) is SharedStore


def test_flag_reaches_the_engine(tiny_bf16):
    with pytest.raises(ValueError, match="kv_connector"):
        LLM(tiny_bf16, kv_connector="json:JSONDecoder", progress=False, num_blocks=20)
