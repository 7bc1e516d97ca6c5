"""Decode CUDA graphs (kvserve/engine/cuda_graphs.py) on the Triton backend: same greedy tokens
as the eager engine, and the null block is zero again after every padded step. On CUDA the
engine captures and replays; on CPU (interpreter) the graph runner's static, padded forward
runs uncaptured: everything a replay computes except the capture itself."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve import SamplingParams  # noqa: E402
from kvserve.engine.cuda_graphs import CudaGraphRunner  # noqa: E402

# slow: Triton static decode forward in the interpreter
pytestmark = pytest.mark.slow

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_static_padded_decode_matches_eager(model_factory, make_llm, kv):
    path = model_factory("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=1)
    # 14 new tokens: the 19-token prompt fills its 2nd block during decode (sealed from the
    # checksum state the graph-path writes accumulated)
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1] + list(range(10, 28))},
               {"prompt_token_ids": [1, 5, 6, 7]},
               {"prompt_token_ids": [1] + list(range(40, 73))}]
    kw = dict(dtype="float32", kv_cache_dtype=kv, num_blocks=16, max_model_len=64,
              attention_backend="triton", max_num_seqs=4, device="cuda" if CUDA else "cpu")
    ref = make_llm(path, enforce_eager=True, **kw).generate(prompts, sp)
    llm = make_llm(path, **kw)
    eng = llm.engine
    if CUDA:
        graphs = eng.runner.graphs
        assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    else:
        assert eng.runner.graphs is None
        graphs = CudaGraphRunner(eng.model, eng.runner.backend, eng.kv_cache,
                                 eng.kv_cache.block_size, 2, max_num_seqs=4, max_model_len=64)
        # not captured: run() executes the static forward eagerly
        eng.runner.executor.driver.model_runner.graphs = graphs
    assert graphs.buckets == (1, 2, 4) and graphs.max_blocks == 4
    got = llm.generate(prompts, sp)
    assert graphs.runs >= 3  # 3 live rows padded to bucket 4 (prefill steps run eagerly)
    assert graphs.replays == (graphs.runs if CUDA else 0)
    null = eng.kv_cache.null_block
    assert not eng.kv_cache.data[:, null].view(torch.uint8).any()  # no fp8 `or` on CUDA
    csum = getattr(eng.kv_cache, "csum_state", None)  # integrity on: the write kernel's sums
    assert csum is None or not csum[:, null].any()
    assert eng.integrity is None or not eng.integrity.failures  # live blocks' sums intact
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
