"""The default of ``--cpu-bf16-dot-rows`` for 16-bit checkpoints (issue 44 item 2): ``auto``,
settled once by the builder before any worker starts (kvserve.config.resolve_bf16_dot_rows) --
1 (bf16 dots for every row of every step, batch-invariant) on CPUs that compute bf16 natively
(AMX, AVX512-BF16), 0 (the exact fp32 dots) elsewhere and with ``--dtype float32``; an explicit
count wins. The CPU kind is simulated (tests/conftest.py's simulate_cpu), so every test holds on
AVX2, AVX-512 and AVX512-BF16 / AMX hosts alike."""

from __future__ import annotations

import pytest
import torch

from kvserve.cbuild import cpu_kind
from kvserve.config import NATIVE_BF16_KINDS, ModelDtypes, resolve_bf16_dot_rows
from kvserve.engine.arg_utils import EngineArgs
from kvserve.kernels.cpu import w16_gemm
from kvserve.sampling_params import SamplingParams
from tests.conftest import SIMULATED_CPUS

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
AUTO = ModelDtypes(fp32, bf16)  # dtype=auto for a bf16 checkpoint, with the 16-bit kernel
WANT = {"avx2": 0, "avx512": 0, "avx512_bf16": 1, "amx": 1}


@pytest.mark.parametrize("kind", list(SIMULATED_CPUS))
def test_auto_resolves_per_cpu_kind(simulate_cpu, kind):
    simulate_cpu(kind)
    k = cpu_kind()
    assert k == kind and (k in NATIVE_BF16_KINDS) == bool(WANT[kind])
    rows, why = resolve_bf16_dot_rows("auto", AUTO, "cpu", k)
    assert rows == WANT[kind] and why.startswith("auto") and kind in why
    # a build without the path (KVSERVE_CPU_BUILD=avx2 on such a CPU) keeps fp32 dots
    assert resolve_bf16_dot_rows("auto", AUTO, "cpu", k, built=False)[0] == 0
    # --dtype float32 (fp32 weight copies) is always the exact path, as is bf16 compute, fp16
    # tables (bf16 dots read bf16 tables only) and a GPU
    for dtypes in (ModelDtypes(fp32, fp32), ModelDtypes(bf16, bf16), ModelDtypes(fp32, fp16)):
        assert resolve_bf16_dot_rows("auto", dtypes, "cpu", k)[0] == 0, dtypes
    assert resolve_bf16_dot_rows("auto", ModelDtypes(bf16, bf16), "cuda", k)[0] == 0
    # an explicit count wins; the environment decides auto where it is set
    assert resolve_bf16_dot_rows(16, AUTO, "cpu", k) == (16, "set explicitly")
    assert resolve_bf16_dot_rows(0, AUTO, "cpu", k) == (0, "set explicitly")
    assert resolve_bf16_dot_rows("auto", AUTO, "cpu", k, env="128")[0] == 128
    assert resolve_bf16_dot_rows("auto", AUTO, "cpu", k, env="0")[0] == 0
    with pytest.raises(ValueError, match="KVSERVE_CPU_BF16_ROWS"):
        resolve_bf16_dot_rows("auto", AUTO, "cpu", k, env="many")


def test_engine_args_take_auto_or_a_count():
    assert EngineArgs().cpu_bf16_dot_rows == "auto"
    assert EngineArgs(cpu_bf16_dot_rows=None).cpu_bf16_dot_rows == "auto"  # the old default
    assert EngineArgs(cpu_bf16_dot_rows="16").cpu_bf16_dot_rows == 16  # as the CLI gives it
    assert EngineArgs(cpu_bf16_dot_rows=0).cpu_bf16_dot_rows == 0
    for bad in (-1, "many", True, 1.5):
        with pytest.raises(ValueError, match="cpu_bf16_dot_rows"):
            EngineArgs(cpu_bf16_dot_rows=bad)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> str:
    from tests.conftest import make_tiny_model

    # K = 128: whole 16-column AMX steps and a masked tail of none
    return make_tiny_model(str(tmp_path_factory.mktemp("bf16dot") / "m"), "llama",
                           save_dtype=bf16, hidden_size=128, intermediate_size=256)


@pytest.mark.parametrize("kind", list(SIMULATED_CPUS))
def test_settle_resolves_auto_before_the_workers(simulate_cpu, monkeypatch, bf16_folder, kind):
    """The builder's one resolution (no weight read, no worker): per CPU kind for a bf16
    folder, 0 with dtype=float32, an explicit count kept."""
    from kvserve.engine.builder import settle

    class Built:  # a kernel build with the bf16 dot path (w16_gemm.bind)
        bf16_dot_built = True

    simulate_cpu(kind)
    monkeypatch.setattr(w16_gemm, "w16_library", lambda: Built())
    monkeypatch.delenv("KVSERVE_CPU_BF16_ROWS", raising=False)
    settled = settle(EngineArgs(model=bf16_folder))
    assert settled.dtypes == AUTO
    assert settled.args.cpu_bf16_dot_rows == WANT[kind]
    assert settled.bf16_dot_rows_note.startswith("auto")
    assert settle(EngineArgs(model=bf16_folder, dtype="float32")).args.cpu_bf16_dot_rows == 0
    assert settle(EngineArgs(model=bf16_folder, cpu_bf16_dot_rows=7)).args.cpu_bf16_dot_rows == 7


def _host_default() -> int:
    """What auto gives a bf16 folder on this host (its kind and its native build)."""
    lib = w16_gemm.w16_library()
    native = lib is not None and getattr(lib, "bf16_dot_built", False)
    return int(cpu_kind() in NATIVE_BF16_KINDS and native)


def test_default_rows_stay_batch_invariant(make_llm, bf16_folder, monkeypatch):
    """With the resolved default (bf16 dots for every row on an AVX512-BF16 / AMX host, fp32
    dots elsewhere) a prompt's greedy tokens and logprobs are the same bit for bit alone and
    in a batch of other prompts, chunked prefills sharing steps with decode rows: alone its
    GEMMs have <= 7 rows, batched up to 48 (on AMX: the in-place tiles, then the blocked path
    from 24 rows)."""
    if w16_gemm.w16_library() is None:
        pytest.skip("no C compiler: torch's GEMMs make no batch-invariance promise")
    monkeypatch.delenv("KVSERVE_CPU_BF16_ROWS", raising=False)
    llm = make_llm(bf16_folder, enable_prefix_caching=False, max_num_batched_tokens=48)
    assert llm.engine.args.cpu_bf16_dot_rows == _host_default()
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    mine = [5, 9, 17, 33, 100, 7, 250]
    others = [[int(t) for t in torch.randint(3, 500, (n,), generator=torch.Generator()
                                             .manual_seed(n))] for n in (40, 3, 30)]
    alone = llm.generate([mine], sp)[0].outputs[0]
    batched = llm.generate([others[0], mine, *others[1:]], [sp] * 4)[1].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs  # bit for bit


def test_default_against_the_exact_path(make_llm, bf16_folder, monkeypatch):
    """dtype=auto against dtype=float32 (always exact: fp32 weight copies) on the same prompt:
    equal up to fp32 summation order where auto keeps fp32 dots; where it takes bf16 dots
    (this host an AVX512-BF16 / AMX CPU), off the exact logits by about bf16's rounding of
    the activations (docs/cpu.md: KL 1.9e-4 on SmolLM2), not more."""
    monkeypatch.delenv("KVSERVE_CPU_BF16_ROWS", raising=False)
    ids = [5, 9, 17, 33, 100, 7, 250, 3, 8, 41, 77, 90]
    auto = make_llm(bf16_folder).engine
    exact = make_llm(bf16_folder, dtype="float32").engine
    assert exact.args.cpu_bf16_dot_rows == 0
    dots = auto.args.cpu_bf16_dot_rows
    assert dots == _host_default()
    a, b = auto.prompt_logits(ids).double(), exact.prompt_logits(ids).double()
    diff = (a - b).abs().max().item()
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    if dots:
        assert diff > 1e-5  # the bf16 dots ran
        assert kl.mean().item() < 1e-2 and diff < 0.5
    else:
        assert diff < 1e-4 and kl.max().item() < 1e-8


def test_log_and_fingerprint_name_the_dots(make_llm, bf16_folder, monkeypatch, caplog):
    """The start-up log says what auto settled and why; the KV fingerprint (prefix-cache
    hashes, KV tiers) differs between the two arithmetics exactly where bf16 dots run, so
    neither reuses KV the other computed."""
    monkeypatch.delenv("KVSERVE_CPU_BF16_ROWS", raising=False)
    with caplog.at_level("INFO", logger="kvserve"):
        auto = make_llm(bf16_folder).engine
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("cpu_bf16_dot_rows"))
    assert line.startswith(f"cpu_bf16_dot_rows {_host_default()} (auto: ")
    exact = make_llm(bf16_folder, cpu_bf16_dot_rows=0).engine
    again = make_llm(bf16_folder, cpu_bf16_dot_rows=0).engine
    assert exact.config.fingerprint == again.config.fingerprint
    assert (auto.config.fingerprint != exact.config.fingerprint) == bool(_host_default())
