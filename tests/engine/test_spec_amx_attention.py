"""Speculative decoding with the attention kernel's AMX-BF16 job on (kvserve/csrc/
paged_attention.c, ``KVSERVE_CPU_AMX_ATTN``): greedy tokens and logprobs identical to
speculation off, on a tiny model whose heads are 64 wide (the job's shapes: head_dim % 32 == 0,
3 query heads per KV head), decode graphs on and off, BF16 and INT8 KV (K / V rows read in
place, and converted). The verify rows are tiled (a table per row, see paged_attention.c), so
an output that depended on the tile would show here (checked: 1e-5 relative per row does).
Skipped without AMX-BF16."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.kernels.cpu import paged_attention as cpu_kernel
from tests.engine.test_speculative import NGRAM, SUFFIX, _p, _prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def amx_model(tmp_path_factory):
    from tests.conftest import make_tiny_model

    dll = cpu_kernel.load()
    was = cpu_kernel.has_amx(dll) if dll is not None else False
    if dll is None or not cpu_kernel.set_amx(dll, True):
        pytest.skip("no AMX-BF16 attention job on this CPU")
    cpu_kernel.set_amx(dll, was)
    return make_tiny_model(str(tmp_path_factory.mktemp("spec_amx")), "llama",
                           save_dtype=torch.bfloat16, hidden_size=192, num_attention_heads=3,
                           num_key_value_heads=1)


@pytest.fixture
def amx_on(monkeypatch):
    dll = cpu_kernel.load()
    was = cpu_kernel.has_amx(dll)
    monkeypatch.setenv("KVSERVE_CPU_AMX_ATTN", "1")  # (engines in other processes)
    cpu_kernel.set_amx(dll, True)
    yield
    cpu_kernel.set_amx(dll, was)


def _run(llm):
    outs = llm.generate([_p(p) for p in _prompts()], GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(("kv", "graph"), [("bf16", True), ("bf16", False),
                                           ("int8_plain", True)])
def test_greedy_identical_with_amx_attention(amx_model, make_llm, amx_on, kv, graph):
    kw = {"kv_cache_dtype": kv} if graph else {"kv_cache_dtype": kv, "enforce_eager": True}
    reference = _run(make_llm(amx_model, **kw))
    for spec in (NGRAM, SUFFIX):  # every proposal verified (not only where drafting pays)
        llm = make_llm(amx_model, speculative_config={**spec, "adaptive": False}, **kw)
        assert _run(llm) == reference, spec
        assert llm.engine.stats().spec_decode["num_accepted_tokens"] > 0
