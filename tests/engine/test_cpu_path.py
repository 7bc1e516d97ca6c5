"""``dtype=auto`` on every CPU kind (issue 31): the fp32-activation C path with the weights kept
compressed, whatever the CPU's flags say -- AVX2 only, AVX-512 without BF16, AVX512-BF16 + VNNI,
AMX (simulated: kvserve's flag probe and torch's capability string are patched) -- and the
start-up log naming the kind and the path."""

from __future__ import annotations

import pytest
import torch

from kvserve.cbuild import cpu_kind
from kvserve.config import ModelDtypes, resolve_model_dtypes
from kvserve.kernels.cpu.w16_gemm import w16_library
from tests.conftest import SIMULATED_CPUS

KINDS = list(SIMULATED_CPUS)
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("kind", KINDS)
def test_kind_is_read_from_the_flags(simulate_cpu, kind):
    simulate_cpu(kind)
    assert cpu_kind() == kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ckpt", [bf16, fp16])
def test_auto_is_fp32_activations_with_16bit_weights(simulate_cpu, kind, ckpt):
    simulate_cpu(kind)
    assert resolve_model_dtypes("auto", ckpt, "cpu", 135_000_000, w16_kernel=True) == \
        ModelDtypes(fp32, ckpt)
    # a model too big for fp32 copies still computes in fp32 when the kernel reads 16-bit
    assert resolve_model_dtypes("auto", ckpt, "cpu", 70 * 10**9, w16_kernel=True) == \
        ModelDtypes(fp32, ckpt)
    # no C kernel: fp32 copies while they fit, else the checkpoint's own dtype
    assert resolve_model_dtypes("auto", ckpt, "cpu", 10**6) == ModelDtypes(fp32, fp32)
    assert resolve_model_dtypes("auto", ckpt, "cpu", 70 * 10**9) == ModelDtypes(ckpt, ckpt)
    # what the user asks for, on any kind; GPUs compute in the checkpoint's dtype
    assert resolve_model_dtypes("bfloat16", ckpt, "cpu", w16_kernel=True) == \
        ModelDtypes(bf16, bf16)
    assert resolve_model_dtypes("auto", ckpt, "cuda", w16_kernel=False) == \
        ModelDtypes(ckpt, ckpt)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_takes_the_c_path_and_logs_it(simulate_cpu, kind, make_llm, tmp_path, caplog):
    """A bf16 checkpoint with ``dtype=auto``: fp32 compute, bf16 weight tables, the decode
    graph recorded, and one log line naming the CPU kind and the path."""
    from tests.conftest import make_tiny_model

    if w16_library() is None:
        pytest.skip("no C compiler: the path is pure torch")
    simulate_cpu(kind)
    path = make_tiny_model(str(tmp_path / "m"), "llama", save_dtype=bf16)
    with caplog.at_level("INFO", logger="kvserve"):
        llm = make_llm(path)
    assert llm.engine.model_config.dtype == fp32
    assert llm.engine.model.model.layers[0].mlp.down_proj.weight.dtype == bf16
    line = next(r.getMessage() for r in caplog.records if "CPU path:" in r.getMessage())
    assert line.startswith(f"CPU path: {kind}")
    assert "activations fp32, dense weights bf16" in line and "16-bit GEMM" in line
    g = llm.engine.runner.graphs
    assert g is not None and g.refused is None
