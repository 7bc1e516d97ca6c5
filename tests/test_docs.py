"""The documentation stays true to the tree: the README stays short, every repository path and
link the README and docs/*.md name exists (anchors included), docs/design.md's layout map
names every module, package and C source of kvserve/, and docs/benchmarks.md lists every
benchmark JSON."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# a backticked repository path: starts with one of the top-level folders that hold files
PATH_RE = re.compile(r"`((?:kvserve|docs|benchmarks|scripts|tests|\.ci)/[^`\s]*)`")
BARE_BENCH_RE = re.compile(r"(?<![\w/`.])(docs/bench/[\w./-]+\.(?:json|png))")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)  # fences, list-indented too
INDENTED_CODE_RE = re.compile(r"^ {4,}\S")  # an indented code line (prose is indented < 4)


def _prose(path: pathlib.Path) -> str:
    """The file without its code blocks, fenced or indented (commands there name files they
    will write)."""
    text = FENCE_RE.sub("", path.read_text())
    return "\n".join(line for line in text.splitlines() if not INDENTED_CODE_RE.match(line))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(path).splitlines()
            if re.match(r"#{1,6} ", line)}


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300: move detail out)"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_paths_exist(doc):
    text = _prose(doc)
    named = set(PATH_RE.findall(text)) | set(BARE_BENCH_RE.findall(text))
    # globs, templates and placeholders ({kv}, *, <name>, $VAR) name no single file
    named = {p.split("::")[0].rstrip(".,:;)") for p in named if not re.search(r"[{}*<>$]", p)}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    bad = []
    for target in LINK_RE.findall(_prose(doc)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists() or (anchor and dest.suffix == ".md"
                                 and anchor not in _anchors(dest)):
            bad.append(target)
    assert not bad, f"{doc.name} has links to nothing: {bad}"


def _layout_entries() -> set[str]:
    """The first word of each entry line of the map (continuation lines are indented to the
    description column)."""
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("## Layout")
    block = text[text.index("```", start) + 3:]
    lines = block[: block.index("```")].splitlines()
    return {line.split()[0] for line in lines
            if line.strip() and len(line) - len(line.lstrip()) < 16}


def test_design_layout_names_every_module_and_package():
    """One line per module: its first word is the file name (or ``package/``)."""
    listed = _layout_entries()
    pkg = ROOT / "kvserve"
    files = sorted(p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")
                   if p.name != "__init__.py")
    packages = sorted(p.parent.relative_to(pkg).as_posix() for p in pkg.rglob("__init__.py")
                      if p.parent != pkg)
    sources = sorted(p.name for p in (pkg / "csrc").iterdir() if p.suffix in (".c", ".h"))
    missing = ([f for f in files if f.rsplit("/", 1)[-1] not in listed]
               + [f"{d}/" for d in packages if d.rsplit("/", 1)[-1] + "/" not in listed]
               + [f"csrc/{c}" for c in sources if c not in listed])
    assert not missing, f"docs/design.md's layout map misses: {missing}"


def test_design_layout_names_nothing_that_is_gone():
    pkg = ROOT / "kvserve"
    names = {p.name for p in pkg.rglob("*") if "__pycache__" not in p.parts}
    names |= {p.name + "/" for p in pkg.rglob("*") if p.is_dir()} | {"kvserve/"}
    stale = sorted(w for w in _layout_entries() if w not in names)
    assert not stale, f"docs/design.md's layout map names files that do not exist: {stale}"


def test_every_benchmark_result_is_listed():
    """docs/benchmarks.md's table names every JSON under docs/bench/ (or its folder): no
    figure without its date and CPU."""
    table = (ROOT / "docs" / "benchmarks.md").read_text()
    listed = set(re.findall(r"^\| `(docs/bench/[^`]+)`", table, re.M))
    unlisted = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs" / "bench").rglob("*.json"))
                if str(p.relative_to(ROOT)) not in listed
                and not any(str(p.relative_to(ROOT)).startswith(d) for d in listed
                            if d.endswith("/"))]
    assert not unlisted, f"add to docs/benchmarks.md's table: {unlisted}"
