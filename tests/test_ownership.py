"""Who owns what (issue 30), checked on the source so that a change that moves a concept back
into the wrong module fails here:

- ``auto``: settled once, in config.py and engine/builder.py; no other module of the engine
  stack compares a setting with "auto" (server/ and router/ keep request-level choices such
  as OpenAI's ``tool_choice: "auto"``, which are not settings). Only the builder turns
  ``EngineArgs`` into configs; workers read the settled ones.
- the KV mode: no layer (attention/, cache/, kernels/, engine/) compares a torch dtype to
  decide the KV storage kind; they ask the mode (``KVMode`` / ``KVStorage`` in config.py).
- names: KV modes say their rotation; test hooks live behind ``engine.debug``.
- the step: only the scheduler's apply step (``Scheduler.update_from_output``) advances a
  request (``num_computed_tokens``, appended tokens); only the runner samples.
- the pure-torch twins of the kernels and quantizers: kvserve/kernels/reference/ only.
"""

from __future__ import annotations

import ast
import pathlib

import kvserve

ROOT = pathlib.Path(kvserve.__file__).parent


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for p in sorted(ROOT.rglob("*.py"))}


def _enclosing_functions(tree: ast.Module) -> dict[ast.AST, str]:
    """node -> the name of the innermost function containing it ("" at module level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else fn
            owner[child] = name
            visit(child, name)

    visit(tree, "")
    return owner


def _assigns_attr(node: ast.AST, attr: str) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    return any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets)


def _appends_to(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend")
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == attr)


def test_only_the_scheduler_advances_requests():
    """``num_computed_tokens`` is assigned and sampled tokens appended only in
    engine/scheduler.py, and there the tokens only in ``update_from_output``."""
    bad = []
    for path, tree in _sources().items():
        owner = _enclosing_functions(tree)
        for node in ast.walk(tree):
            if _assigns_attr(node, "num_computed_tokens") and path != "engine/scheduler.py":
                bad.append(f"{path}:{node.lineno} assigns num_computed_tokens")
            if _appends_to(node, "output_token_ids") and (
                    path != "engine/scheduler.py" or owner[node] != "update_from_output"):
                bad.append(f"{path}:{node.lineno} appends a sampled token")
    assert not bad, bad


def test_the_engine_neither_samples_nor_advances():
    """llm_engine.py drives the step: no sampler, no request-state writes, and it hands the
    runner's output to the scheduler's apply step."""
    tree = _sources()["engine/llm_engine.py"]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    assert not {"Sampler", "SampleRow", "sampler"} & (names | attrs | imported)
    writes = [n.lineno for n in ast.walk(tree)
              if _assigns_attr(n, "num_computed_tokens") or _assigns_attr(n, "status")
              or _appends_to(n, "output_token_ids")]
    assert not writes, f"llm_engine.py writes request state at lines {writes}"
    assert "update_from_output" in attrs and "execute_model" in attrs


def test_only_the_runner_samples():
    """The sampler is used by engine/step_runner.py only (and defined in engine/sampler.py)."""
    users = sorted(path for path, tree in _sources().items()
                   if any(isinstance(n, ast.Name) and n.id in ("Sampler", "SampleRow")
                          for n in ast.walk(tree)))
    assert users == ["engine/sampler.py", "engine/step_runner.py"], users


def test_kv_mode_names_say_their_rotation():
    """8-bit KV modes name their rotation (``_rot`` / ``_plain``); the old short names keep
    their meaning (``int8`` rotated, ``fp8`` not)."""
    from kvserve.config import parse_kv_mode

    for old, new in [("int8", "int8_rot"), ("fp8", "fp8_e4m3_plain"),
                     ("fp8_e4m3", "fp8_e4m3_plain"), ("fp8_e5m2", "fp8_e5m2_plain"),
                     ("fp8_rot", "fp8_e4m3_rot"), ("int8_plain", "int8_plain")]:
        assert parse_kv_mode(old) == parse_kv_mode(new)
        assert parse_kv_mode(old).name == new
        assert parse_kv_mode(new).rotate == new.endswith("_rot")
    assert parse_kv_mode("bf16").name == "bf16"


def test_test_hooks_live_behind_engine_debug():
    """Fault injection, leak checks and the schedule observer are not the engine's API."""
    from kvserve.engine.llm_engine import LLMEngine

    for hook in ("inject_kv_fault", "check_no_leaks", "on_schedule", "gather_kv"):
        assert not hasattr(LLMEngine, hook), hook
    tree = _sources()["engine/llm_engine.py"]
    assert "on_schedule" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                 and isinstance(n.value, ast.Name) and n.value.id == "self"}


_KV_DTYPES = {"int8", "float8_e4m3fn", "float8_e5m2"}
_KV_KIND_HELPERS = {"is_fp8", "is_scaled", "kv_scale_dtype", "kv_scale_bytes", "FP8_DTYPES",
                    "SCALED_KV_DTYPES"}


def _kv_kind_tests(node: ast.AST) -> list[str]:
    """Where ``node`` decides a KV storage kind from a dtype: a comparison with torch.int8 /
    torch.float8_*, membership in a tuple of them, or a free dtype -> kind helper (config had
    them once; ``KVStorage`` is now the one home of those facts)."""
    found = []
    for n in ast.walk(node):
        if isinstance(n, ast.Compare):
            for part in ast.walk(n):
                if isinstance(part, ast.Attribute) and part.attr in _KV_DTYPES and \
                        isinstance(part.value, ast.Name) and part.value.id == "torch":
                    found.append(f"{n.lineno}: compares with torch.{part.attr}")
        # the helpers by name or through a module (``ref.is_fp8``); ``mode.is_fp8`` is the mode
        name = n.id if isinstance(n, ast.Name) else n.attr if (
            isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in ("ref", "reference", "config")) else None
        if name in _KV_KIND_HELPERS:
            found.append(f"{n.lineno}: uses config.{name}")
    return found


def test_no_layer_derives_the_kv_kind_from_a_dtype():
    bad = [f"{path}:{hit}" for path, tree in _sources().items()
           if path.split("/")[0] in ("attention", "cache", "kernels", "engine")
           for hit in _kv_kind_tests(tree)]
    assert not bad, bad


def test_the_kv_kind_check_finds_dtype_comparisons():
    """The scan catches what it is meant to (so the test above can fail)."""
    for src in ("x = kv.dtype == torch.int8", "y = d in (torch.float8_e4m3fn, torch.bfloat16)",
                "z = is_scaled(kv.dtype)", "w = d in FP8_DTYPES", "v = ref.is_fp8(d)"):
        assert _kv_kind_tests(ast.parse(src)), src
    assert not _kv_kind_tests(ast.parse("x = kv.mode.is_int8 and q.dtype == torch.float32"))


_AUTO_HOMES = {"config.py", "engine/builder.py"}
_REQUEST_LEVEL = ("server", "router", "bench")  # "auto" there is a per-request choice


def _auto_tests(tree: ast.AST) -> list[int]:
    """Lines comparing something with the string "auto" (==, !=, in (...))."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
            and any(isinstance(c, ast.Constant) and c.value == "auto"
                    for part in (n.left, *n.comparators) for c in ast.walk(part))]


def test_auto_is_settled_only_in_config_and_builder():
    bad = [f"{path}:{line}" for path, tree in _sources().items()
           if path not in _AUTO_HOMES and path.split("/")[0] not in _REQUEST_LEVEL
           for line in _auto_tests(tree)]
    assert not bad, f"these modules resolve an 'auto' (move it to config / builder): {bad}"
    assert _auto_tests(ast.parse("if name == 'auto': pass"))
    assert _auto_tests(ast.parse("x = kind in ('auto', 'prefix')"))


def test_configs_are_built_from_engine_args_only_by_the_builder():
    """Workers and the engine read the settled configs (``WorkerConfig`` / ``EngineConfig``);
    only engine/builder.py turns ``EngineArgs`` into them."""
    makers = ("cache_config", "scheduler_config", "transfer_config")
    bad = [f"{path}:{n.lineno}" for path, tree in _sources().items()
           if path not in ("engine/builder.py", "engine/arg_utils.py")
           for n in ast.walk(tree) if isinstance(n, ast.Call)
           and isinstance(n.func, ast.Attribute) and n.func.attr in makers]
    assert not bad, f"configs rebuilt from EngineArgs outside the builder: {bad}"


def test_kv_auto_is_resolved_against_the_checkpoint_by_config():
    """``kv_cache_dtype=auto``: the checkpoint's 16-bit dtype even when computed in fp32, else
    the model's compute dtype; explicit modes pass through."""
    import torch

    from kvserve.config import KVMode, resolve_checkpoint_kv_mode

    bf16, f32 = torch.bfloat16, torch.float32
    assert resolve_checkpoint_kv_mode("auto", "auto", bf16, "cpu") == KVMode(bf16)
    assert resolve_checkpoint_kv_mode("auto", "fp32", bf16, "cpu") == KVMode(bf16)
    assert resolve_checkpoint_kv_mode("auto", "auto", f32, "cpu") == KVMode(f32)
    assert resolve_checkpoint_kv_mode("auto", "bf16", f32, "cpu") == KVMode(bf16)
    assert resolve_checkpoint_kv_mode("int8", "auto", f32, "cpu") == KVMode(torch.int8, True)


# The twins' one home; kernels/cpu and kernels/triton bind the kernels under the twins' names.
_TWIN_HOME = "kernels/reference/"
_KERNEL_BINDINGS = ("kernels/cpu/", "kernels/triton/")
# Same name, not a twin: the INT4 format's signed unpacker, the debug KV dump, logprob decoding.
_NOT_TWINS = {("quant/int4.py", "unpack_int4"), ("engine/debug.py", "gather_kv"),
              ("engine/executor.py", "gather_kv"), ("server/logprobs.py", "decode")}
# Calls that make a pure-torch twin: the quantizers' rounding and the attention math.
_TWIN_MATH = {"round", "clamp", "clamp_", "searchsorted", "softmax",
              "scaled_dot_product_attention", "index_copy_"}
# Modules that dispatch to a kernel and so must not carry their own torch fallback (mla_torch
# is the MLA path itself, with no kernel beside it on CPU, and so is not here).
_DISPATCHERS = ("cache/kv_cache.py", "attention/cpu_backend.py", "attention/triton_backend.py",
                "attention/mla_triton.py", "quant/fp8.py", "quant/int8.py", "quant/w16.py",
                "quant/wq.py")


def _math_calls(tree: ast.AST) -> list[str]:
    return [f"{n.lineno}: {n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id}"
            for n in ast.walk(tree) if isinstance(n, ast.Call) and (
                (isinstance(n.func, ast.Attribute) and n.func.attr in _TWIN_MATH)
                or (isinstance(n.func, ast.Name) and n.func.id in _TWIN_MATH))]


def test_one_home_for_the_pure_torch_twins():
    """Every pure-torch twin of a kernel or quantizer is defined in kernels/reference/: no
    other module defines a function of a twin's name (the kernel bindings aside), and the
    modules that dispatch to a kernel (the cache's writer, the attention backends) or define a
    format (quant/) hold no torch fallback of their own."""
    sources = _sources()
    twins = {n.name for path, tree in sources.items() if path.startswith(_TWIN_HOME)
             for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    assert {"write_kv", "write_rows", "paged_attention", "fp8_quantize", "int8_quantize",
            "w16_linear", "wq_matmul", "decode", "prefill"} <= twins
    second = [f"{path}:{n.lineno} {n.name}" for path, tree in sources.items()
              if not path.startswith((_TWIN_HOME, *_KERNEL_BINDINGS))
              for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and n.name in twins and (path, n.name) not in _NOT_TWINS]
    assert not second, f"a second twin (move it to kvserve/{_TWIN_HOME}): {second}"
    fallbacks = [f"{path}:{hit}" for path in _DISPATCHERS for hit in _math_calls(sources[path])]
    assert not fallbacks, f"torch math outside kvserve/{_TWIN_HOME}: {fallbacks}"


def test_the_twin_scan_sees_twin_math():
    """The scan catches what it is meant to (so the test above can fail)."""
    for src in ("y = torch.round(x / s).clamp_(-127, 127)", "flat.index_copy_(0, r, q)",
                "o = F.scaled_dot_product_attention(q, k, v)", "p = scores.softmax(-1)"):
        assert _math_calls(ast.parse(src)), src


def test_the_cache_chooses_its_writer_when_built():
    """The KV cache's writer (C / Triton / twin) and the Triton writer's checksum state are set
    in ``PagedKVCache.__init__`` only: no backend swaps them afterwards."""
    bad = []
    for path, tree in _sources().items():
        owner = _enclosing_functions(tree)
        for node in ast.walk(tree):
            if any(_assigns_attr(node, a) for a in ("writer", "_fused_write", "csum_state")) \
                    and (path, owner[node]) != ("cache/kv_cache.py", "__init__"):
                bad.append(f"{path}:{node.lineno}")
    assert not bad, f"the cache's writer is set outside PagedKVCache.__init__: {bad}"
