"""Shared fixtures: tiny random-init HF models saved with save_pretrained, built once per
session, and a leak check after every test that used an engine."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without CUDA the Triton kernel tests run under triton's interpreter, which must be switched on
# BEFORE triton is first imported. Test modules imported while collecting (transformers, peft and
# kvserve's LoRA layer among them) may import it, so the switch is here, in the first conftest
# pytest loads (tests/kernels/conftest.py repeats it for a run of that folder alone).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ENGINES: list = []


def make_tiny_model(path: str, arch: str = "llama", save_dtype: torch.dtype = torch.float32,
                    **overrides) -> str:
    """Random-init tiny HF model + a tokenizer, saved to ``path`` (tensors and config dtype in
    ``save_dtype``)."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[arch]
    cfg = cfg_cls(**common)
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.float32)
    # Sharper logits than the default init so greedy decoding is not knife-edge.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif arch == "gemma3":  # its (1 + w) norms init w = 0: make w matter
                p.normal_(0, 0.3)
    model.to(save_dtype).save_pretrained(path)
    save_tiny_tokenizer(path, common["vocab_size"])
    return path


def save_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over a fixed vocabulary (no network, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    fast.save_pretrained(path)


# The builds of each C kernel its tests check against the twin: the native one (-march=native)
# and every variant of kvserve.cbuild.ISA_FLAGS (avx512_emu / bf16_emu: the AVX-512 code with
# its intrinsics emulated, so it runs on AVX2 machines too).
# The native build runs in the inner loop; the other ISA builds (compiled by the tests) are
# marked slow, so `pytest -m "not slow"` skips them and CI runs them all.
def isa_variants(*without: str) -> tuple:
    """"native" plus every variant but ``without`` (an emulated build that compiles the same
    code as another for a kernel, e.g. avx512_emu for one with no AVX-512-only code)."""
    return ("native", *(pytest.param(isa, marks=pytest.mark.slow)
                        for isa in ("avx2", "portable", "avx512", "bf16", "avx512_emu",
                                    "bf16_emu") if isa not in without))


ISA_VARIANTS = isa_variants()


def require_simde() -> None:
    """Skip without SIMDe's headers -- but fail under CI, which installs them (the dev extras):
    there a missing header would turn every emulated AVX-512 test into a green skip."""
    from kvserve.cbuild import simde_include

    if simde_include() is None:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "SIMDe's headers are not installed (pip install simde-py, or apt install "
            "libsimde-dev)")


_VARIANTS: dict = {}  # (name, isa) -> loaded build: each compiles once per session


def variant_library(name: str, isa: str, out_dir: str):
    """``kvserve/csrc/<name>.c`` built for ``isa`` (a non-native ISA_VARIANTS entry) and loaded
    (undeclared). Skips, naming the reason, where this CPU cannot run the variant (the flags it
    lacks), off x86-64 / without a compiler, or when the compiler cannot target the ISA (its
    message in the reason)."""
    import subprocess

    from kvserve.cbuild import EMULATED, ISA_CPU_FLAGS, build_variant, can_run_variant, cpu_flags

    if not can_run_variant(isa):
        lacks = sorted(ISA_CPU_FLAGS[isa] - cpu_flags()) or ["x86-64"]
        pytest.skip(f"this CPU cannot run the {isa} build (lacks {', '.join(lacks)})")
    if (name, isa) in _VARIANTS:
        return _VARIANTS[name, isa]
    if isa in EMULATED:
        require_simde()
    try:
        dll = build_variant(name, isa, out_dir)
    except subprocess.CalledProcessError as e:
        msg = f"the compiler cannot build the {isa} variant: {e.stderr.decode()[-300:]}"
        if isa in EMULATED:  # a Haswell target always compiles: the header or SIMDe broke
            pytest.fail(msg)
        pytest.skip(msg)
    if dll is None:
        pytest.skip("no C compiler, or not x86-64")
    _VARIANTS[name, isa] = dll
    return dll


# /proc/cpuinfo flags of the CPU kinds kvserve tells apart (kvserve.cbuild.CPU_KINDS), for tests
# that simulate one: a Zen 3 (AVX2 only), a Cascade Lake (AVX-512 without BF16), a Zen 4
# (AVX512-BF16 + VNNI) and a Sapphire Rapids (AMX).
_AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_vnni"}
SIMULATED_CPUS: dict[str, tuple[frozenset[str], str]] = {  # kind -> (flags, torch capability)
    "avx2": (_AVX2, "AVX2"),
    "avx512": (_AVX512, "AVX512"),
    "avx512_bf16": (_AVX512 | {"avx512_bf16"}, "AVX512"),
    "amx": (_AVX512 | {"avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}, "AVX512"),
}


@pytest.fixture
def simulate_cpu(monkeypatch):
    """``simulate_cpu(kind)``: kvserve's CPU probe (kvserve.cbuild.cpu_flags) and torch's
    capability string report that kind of CPU (a key of SIMULATED_CPUS) for the test. The C
    kernels still run this CPU's native build: code that would need the simulated ISA checks
    the CPU itself (cpuid) before running it."""
    from kvserve import cbuild
    from kvserve.kernels.cpu import w16_gemm

    def simulate(kind: str) -> None:
        flags, capability = SIMULATED_CPUS[kind]
        monkeypatch.setattr(cbuild, "cpu_flags", lambda: flags)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        w16_gemm.bf16_dot_rows.cache_clear()

    yield simulate
    w16_gemm.bf16_dot_rows.cache_clear()


# Every engine's worker sets its process's bf16 dot threshold (--cpu-bf16-dot-rows, auto: 1 on
# an AVX512-BF16 / AMX CPU for bf16 tables): without these, an engine built by one test would
# decide the arithmetic of the kernel-level 16-bit GEMMs of the tests after it.
@pytest.fixture(autouse=True, scope="module")
def _bf16_dot_rows_per_module():
    """Each test module starts with no engine setting (the environment's: off)."""
    from kvserve.kernels.cpu import w16_gemm

    w16_gemm.set_bf16_dot_rows(None)
    yield
    w16_gemm.set_bf16_dot_rows(None)


@pytest.fixture(autouse=True)
def _bf16_dot_rows_per_test():
    """A test's own engines do not outlive it in the setting (a module's engine fixtures,
    built before this, keep theirs)."""
    from kvserve.kernels.cpu import w16_gemm

    before = w16_gemm.engine_bf16_dot_rows()
    yield
    if w16_gemm.engine_bf16_dot_rows() != before:
        w16_gemm.set_bf16_dot_rows(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    cache: dict = {}

    def make(arch: str, **overrides) -> str:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture
def make_llm():
    """Build kvserve LLMs; after the test, every engine must have all blocks free."""
    from kvserve import LLM

    made = []

    def make(model: str, **kw):
        kw.setdefault("progress", False)
        kw.setdefault("kv_cache_memory", "8MiB")
        llm = LLM(model, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.debug.check_no_leaks()
