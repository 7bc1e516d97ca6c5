"""The package's dependency direction: no import cycle inside ``kvserve``, and no module
importing from a layer above its own (issue 17). Every import counts: module level, inside a
function, under ``TYPE_CHECKING``.

The layer order, written down here once (highest first). A module may import from its own
layer and any layer below it. Layers list package prefixes; the longest prefix decides.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import kvserve

LAYERS: list[tuple[str, ...]] = [
    # entry points: the command line (``serve`` launches replicas and their router), the
    # offline API, benchmarks
    ("kvserve", "kvserve.cli", "kvserve.serve_cli", "kvserve.router_cli", "kvserve.quantize_cli",
     "kvserve.llm", "kvserve.bench"),
    # the replica's HTTP server and the router in front of replicas: siblings (SIBLINGS)
    ("kvserve.server", "kvserve.router"),
    ("kvserve.http",),  # the HTTP plumbing both stand on: errors, middleware, listen, tracing
    ("kvserve.engine",),  # scheduler, executor / workers, step loop
    ("kvserve.model",),  # architectures, checkpoint loading
    ("kvserve.layers", "kvserve.attention"),  # nn building blocks, attention backends
    ("kvserve.cache",),  # block pool, paged KV tensors, integrity
    # math (kernels/cpu: the ctypes bindings, kernels/triton: the Triton kernels, reference/:
    # their twins), number formats, collectives
    ("kvserve.kernels", "kvserve.quant", "kvserve.distributed"),
    # plain data and build helpers; structured outputs (the params SamplingParams holds, the
    # grammars, their bitmasks: self-contained, used from the sampler up to the server)
    ("kvserve.config", "kvserve.request", "kvserve.sampling_params", "kvserve.outputs",
     "kvserve.cbuild", "kvserve.cli_help", "kvserve.config_cli", "kvserve.version",
     "kvserve.structured_output"),
]
# Packages that share a layer but stand apart: none of them imports another (what they share
# lives in a layer below them).
SIBLINGS: list[tuple[str, ...]] = [("kvserve.server", "kvserve.router")]

ROOT = pathlib.Path(kvserve.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The kvserve modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("kvserve") and t != name:
                found.add(t)
    return found


def _layer(name: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS"
    return rank


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    for name in _graph():
        _layer(name)


def test_no_upward_import():
    bad = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
           for m, targets in sorted(_graph().items()) for t in sorted(targets)
           if _layer(t) < _layer(m)]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def _sibling(name: str, group: tuple[str, ...]) -> str | None:
    return next((p for p in group if name == p or name.startswith(p + ".")), None)


def test_no_sideways_import():
    bad = [f"{m} imports its sibling {t}"
           for group in SIBLINGS for m, targets in sorted(_graph().items())
           for t in sorted(targets)
           if _sibling(m, group) is not None and _sibling(t, group) not in (None,
                                                                             _sibling(m, group))]
    assert not bad, "imports between sibling packages:\n" + "\n".join(bad)


def test_checks_catch_a_bad_import(monkeypatch):
    """The checks can fail: a router module importing the server (sideways) or the HTTP
    plumbing importing the server (upward) is reported."""
    graph = dict(_graph())
    graph["kvserve.router.app"] = graph["kvserve.router.app"] | {"kvserve.server.api"}
    graph["kvserve.http.errors"] = graph["kvserve.http.errors"] | {"kvserve.server.state"}
    monkeypatch.setitem(globals(), "_graph", lambda: graph)
    with pytest.raises(AssertionError, match="kvserve.router.app imports its sibling"):
        test_no_sideways_import()
    with pytest.raises(AssertionError, match="kvserve.http.errors .layer 2. imports"):
        test_no_upward_import()


def test_structured_output_is_self_contained():
    """kvserve/structured_output imports nothing of kvserve's outside itself, so any layer may
    use it (issue 41: structured outputs in one package)."""
    bad = [f"{m} imports {t}" for m, targets in sorted(_graph().items())
           if m.startswith("kvserve.structured_output") for t in sorted(targets)
           if not t.startswith("kvserve.structured_output")]
    assert not bad, bad


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_violations():
    """The walk resolves relative and package imports (a checker that sees nothing passes
    everything)."""
    graph = _graph()
    assert "kvserve.cache.kv_cache" in graph["kvserve.attention"]
    assert "kvserve.kernels.cpu.paged_attention" in graph["kvserve.cache.kv_cache"]
    assert _layer("kvserve.engine.llm_engine") < _layer("kvserve.cache.integrity")


def test_one_place_for_c_libraries_and_triton_interpret():
    """ctypes libraries are loaded only by kvserve/kernels/cpu (and built by cbuild.py);
    TRITON_INTERPRET is read only by kvserve/kernels/triton/__init__.py (issue 17, item 4)."""
    loads, interp = [], []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if ("build_library(" in text or "CDLL(" in text) and not (
                rel == "cbuild.py" or rel.startswith("kernels/cpu/")):
            loads.append(rel)
        if 'environ.get("TRITON_INTERPRET"' in text and rel != "kernels/triton/__init__.py":
            interp.append(rel)
    assert not loads, f"C libraries loaded outside kernels/cpu: {loads}"
    assert not interp, f"TRITON_INTERPRET read outside kernels/triton: {interp}"


def test_every_kernel_call_goes_through_launch():
    """Bindings call their C entry points only through kernels.cpu.graph.launch, so a CPU-graph
    recording sees every call (a call it did not see would be silently missing from the
    replay). The replay's own call in graph.py is the one exception."""
    direct = []
    for path in (ROOT / "kernels" / "cpu").glob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(lib|dll)\.kvs_\w+\(", line) and not (
                    path.name == "graph.py" and "kvs_graph_run" in line):
                direct.append(f"{path.name}:{n}")
    assert not direct, f"kernel calls bypassing launch(): {direct}"
