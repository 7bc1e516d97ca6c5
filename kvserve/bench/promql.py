"""A small PromQL evaluator over scraped ``/metrics`` snapshots: what benchmarks/dashboard.py
needs to draw a Grafana dashboard's panels without a Prometheus, and what its test uses to read
which metrics each panel expression names.

The subset: selectors ``name{label="v", label=~"re", ...}`` with an optional range ``[30s]``;
``rate`` and ``increase`` of a range; ``histogram_quantile(q, v)``; ``sum`` / ``max`` / ``min``
/ ``avg`` with ``by (...)`` or ``without (...)`` (before or after the operand); ``+ - * /``
between vectors (matched on equal label sets) and numbers; parentheses. Grafana's ``$var`` /
``${var}`` are replaced from ``variables`` before parsing. Anything else is a ``ValueError``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Labels = frozenset  # of (name, value) pairs
Vector = dict  # Labels -> float
# one scrape: (unix time, {(sample name, Labels): value})
Scrape = tuple[float, dict[tuple[str, Labels], float]]

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|(?P<dur>\[\d+[smh]\])|"
                    r"(?P<str>\"(?:[^\"\\]|\\.)*\")|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)|"
                    r"(?P<op>=~|!~|!=|[-+*/(){},=]))")
_AGGREGATIONS = {"sum": sum, "max": max, "min": min,
                 "avg": lambda xs: sum(xs) / len(xs)}
_FUNCTIONS = ("rate", "increase", "histogram_quantile")


@dataclass(frozen=True, slots=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)
    range_s: float | None

    def matches(self, name: str, labels: Labels) -> bool:
        if name != self.name:
            return False
        d = dict(labels)
        for label, op, value in self.matchers:
            got = d.get(label, "")
            ok = {"=": got == value, "!=": got != value,
                  "=~": re.fullmatch(value, got) is not None,
                  "!~": re.fullmatch(value, got) is None}[op]
            if not ok:
                return False
        return True


@dataclass(frozen=True, slots=True)
class Node:
    kind: str  # num | sel | call | agg | bin
    value: float = 0.0
    sel: Selector | None = None
    name: str = ""  # function / aggregation / operator
    args: tuple[Node, ...] = ()
    grouping: tuple[str, ...] | None = None
    without: bool = False


def substitute(expr: str, variables: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        key = m.group(1) or m.group(2)
        if key not in variables:
            raise ValueError(f"unknown dashboard variable ${key}")
        return variables[key]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks: list[tuple[str, str]] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise ValueError(f"cannot parse {text[pos:pos + 20]!r} in {text!r}")
            self.toks.append((m.lastgroup or "", m.group(m.lastgroup or 0)))
            pos = m.end()
            while pos < len(text) and text[pos].isspace():
                pos += 1
        self.i = 0
        self.text = text

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("", "")

    def take(self, value: str | None = None) -> str:
        kind, tok = self.peek()
        if not kind or (value is not None and tok != value):
            raise ValueError(f"expected {value or 'more'} at token {self.i} of {self.text!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.expr()
        if self.i != len(self.toks):
            raise ValueError(f"trailing {self.peek()[1]!r} in {self.text!r}")
        return node

    def expr(self) -> Node:
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()
            node = Node("bin", name=op, args=(node, self.term()))
        return node

    def term(self) -> Node:
        node = self.unary()
        while self.peek()[1] in ("*", "/"):
            op = self.take()
            node = Node("bin", name=op, args=(node, self.unary()))
        return node

    def labels(self) -> tuple[str, ...]:
        self.take("(")
        out = []
        while self.peek()[1] != ")":
            out.append(self.take())
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(out)

    def unary(self) -> Node:
        kind, tok = self.peek()
        if kind == "num":
            self.take()
            return Node("num", value=float(tok))
        if tok == "(":
            self.take("(")
            node = self.expr()
            self.take(")")
            return node
        if kind != "id":
            raise ValueError(f"unexpected {tok!r} in {self.text!r}")
        self.take()
        if tok in _AGGREGATIONS:
            grouping, without = None, False
            if self.peek()[1] in ("by", "without"):
                without = self.take() == "without"
                grouping = self.labels()
            self.take("(")
            arg = self.expr()
            self.take(")")
            if grouping is None and self.peek()[1] in ("by", "without"):
                without = self.take() == "without"
                grouping = self.labels()
            return Node("agg", name=tok, args=(arg,), grouping=grouping or (), without=without)
        if tok in _FUNCTIONS:
            self.take("(")
            args = [self.expr()]
            while self.peek()[1] == ",":
                self.take(",")
                args.append(self.expr())
            self.take(")")
            return Node("call", name=tok, args=tuple(args))
        if self.peek()[1] == "(":
            raise ValueError(f"unsupported function {tok}() in {self.text!r}")
        matchers = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take()
                op = self.take()
                if op not in ("=", "!=", "=~", "!~"):
                    raise ValueError(f"bad matcher operator {op!r} in {self.text!r}")
                matchers.append((label, op, self.take()[1:-1]))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        range_s = None
        if self.peek()[0] == "dur":
            d = self.take()[1:-1]
            range_s = float(d[:-1]) * {"s": 1, "m": 60, "h": 3600}[d[-1]]
        return Node("sel", sel=Selector(tok, tuple(matchers), range_s))


def parse(expr: str, variables: dict[str, str] | None = None) -> Node:
    return _Parser(substitute(expr, variables or {})).parse()


def selectors(node: Node) -> list[Selector]:
    """Every selector in the expression (the metrics it reads)."""
    out = [node.sel] if node.sel is not None else []
    for a in node.args:
        out += selectors(a)
    return out


def _drop(labels: Labels, keep: Callable[[str], bool]) -> Labels:
    return frozenset((k, v) for k, v in labels if keep(k))


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (le, count) pairs."""
    buckets = sorted(buckets)
    if len(buckets) < 2 or buckets[-1][0] != math.inf or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == math.inf:
                return prev_le
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


class Evaluator:
    """Evaluate expressions at each scrape's time over ``scrapes`` (oldest first)."""

    def __init__(self, scrapes: Sequence[Scrape]) -> None:
        self.scrapes = list(scrapes)

    def _instant(self, sel: Selector, at: int) -> Vector:
        _, samples = self.scrapes[at]
        return {_drop(lbl, lambda k: k != "__name__"): v
                for (name, lbl), v in samples.items() if sel.matches(name, lbl)}

    def _range(self, sel: Selector, at: int) -> dict[Labels, list[tuple[float, float]]]:
        t_end = self.scrapes[at][0]
        assert sel.range_s is not None
        out: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
        for t, samples in self.scrapes[: at + 1]:
            if t < t_end - sel.range_s - 1e-9:
                continue
            for (name, lbl), v in samples.items():
                if sel.matches(name, lbl):
                    out[lbl].append((t, v))
        return out

    def eval(self, node: Node, at: int) -> Vector | float:
        if node.kind == "num":
            return node.value
        if node.kind == "sel":
            assert node.sel is not None
            if node.sel.range_s is not None:
                raise ValueError(f"a range selector outside rate(): {node.sel.name}")
            return self._instant(node.sel, at)
        if node.kind == "call":
            return self._call(node, at)
        if node.kind == "agg":
            return self._agg(node, at)
        a, b = self.eval(node.args[0], at), self.eval(node.args[1], at)
        return _binary(node.name, a, b)

    def _call(self, node: Node, at: int) -> Vector:
        if node.name == "histogram_quantile":
            q = self.eval(node.args[0], at)
            v = self.eval(node.args[1], at)
            if not isinstance(q, float) or not isinstance(v, dict):
                raise ValueError("histogram_quantile(number, vector)")
            groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
            for lbl, x in v.items():
                le = dict(lbl).get("le")
                if le is not None:
                    groups[_drop(lbl, lambda k: k != "le")].append((float(le), x))
            out = {k: _quantile(q, b) for k, b in groups.items()}
            return {k: x for k, x in out.items() if not math.isnan(x)}
        arg = node.args[0]
        if arg.kind != "sel" or arg.sel is None or arg.sel.range_s is None:
            raise ValueError(f"{node.name}() takes a range selector")
        out = {}
        for lbl, pts in self._range(arg.sel, at).items():
            if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
                continue
            delta = max(0.0, pts[-1][1] - pts[0][1])  # a reset counts as no increase
            out[_drop(lbl, lambda k: k != "__name__")] = (
                delta / (pts[-1][0] - pts[0][0]) if node.name == "rate" else delta)
        return out

    def _agg(self, node: Node, at: int) -> Vector:
        v = self.eval(node.args[0], at)
        if not isinstance(v, dict):
            raise ValueError(f"{node.name}() takes a vector")
        keys = set(node.grouping or ())
        groups: dict[Labels, list[float]] = defaultdict(list)
        for lbl, x in v.items():
            groups[_drop(lbl, (lambda k: k not in keys) if node.without
                         else (lambda k: k in keys))].append(x)
        return {k: _AGGREGATIONS[node.name](xs) for k, xs in groups.items()}

    def series(self, expr: str, variables: dict[str, str] | None = None
               ) -> dict[Labels, list[tuple[float, float]]]:
        """Each result series of ``expr`` as (time, value) points, one per scrape where it
        has a value."""
        node = parse(expr, variables)
        out: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
        for i, (t, _) in enumerate(self.scrapes):
            v = self.eval(node, i)
            if isinstance(v, float):
                v = {frozenset(): v}
            for lbl, x in v.items():
                if math.isfinite(x):
                    out[lbl].append((t, x))
        return dict(out)


def _binary(op: str, a: Vector | float, b: Vector | float) -> Vector | float:
    def f(x: float, y: float) -> float:
        if op == "+":
            return x + y
        if op == "-":
            return x - y
        if op == "*":
            return x * y
        return x / y if y else math.nan
    if isinstance(a, float) and isinstance(b, float):
        return f(a, b)
    if isinstance(a, float):
        assert isinstance(b, dict)
        return {k: f(a, y) for k, y in b.items()}
    if isinstance(b, float):
        return {k: f(x, b) for k, x in a.items()}
    return {k: f(x, b[k]) for k, x in a.items() if k in b}


def scrape_samples(text: str, extra: dict[str, str] | None = None
                   ) -> dict[tuple[str, Labels], float]:
    """A /metrics text as {(sample name, labels): value}, ``extra`` labels added (e.g. the
    instance it came from)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset({**s.labels, **(extra or {})}.items()))] = s.value
    return out
