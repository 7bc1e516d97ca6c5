"""Tool-call formats (``--tool-call-parser``): how a model writes its function calls, how to
read them back out of the text, and the grammars that force them (``tool_choice`` required or
a named function: ``ToolParser.grammar``) or let the model choose between text and calls whose
strict tools' arguments follow their schemas (``auto`` with ``strict`` tools:
``ToolParser.auto_grammar``).

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block
  per call, after optional text (Hermes, Qwen 2.5 / 3, kvserve's templates/hermes_tools.jinja).
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (``arguments``
  accepted too), several separated by ``;`` (Llama 3.1 / 3.2).
- ``pythonic``: the whole answer is ``[f(a=1, b="x"), g()]`` (Llama 3.2 / 4 pythonic,
  ToolACE); JSON's true / false / null are read as Python's.

``ToolParser.extract`` turns a finished text into (content, calls); ``StreamingToolCalls``
streams the text before a call as content, holds the rest, and extracts the calls from the
whole text at the end, so streamed and non-streamed answers carry the same calls.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from kvserve.server.settings import TOOL_CALL_PARSERS as PARSERS
from kvserve.structured_output.backend import lark_json, lark_literal

_lit = lark_literal  # the grammars below are written with many literals


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    parameters: dict  # a JSON schema (an object's)
    strict: bool = True  # False: any JSON object passes as the arguments (auto's loose tools)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _args_text(args: object) -> str | None:
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _call_from_json(obj: object, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    text = _args_text(args)
    return ParsedCall(obj["name"], text) if text is not None else None


def _object_schema(tool: ToolSpec, args_key: str) -> dict:
    args = tool.parameters if tool.strict else {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": tool.name}, args_key: args},
            "required": ["name", args_key], "additionalProperties": False}


def _not_starting_with(prefix: str, start: str) -> str:
    """A Lark lexeme: any text whose stripped form does not start with ``start`` (after an
    optional ``prefix`` and whitespace): what the parser's ``extract`` reads as no call."""
    head = rf"\s*({re.escape(prefix)}\s*)?{re.escape(start)}"
    return f"/(?s:.*)/ & ~/{head}(?s:.*)/"


class ToolParser:
    name = ""
    starts_with = ""  # the answer is calls iff its stripped text starts with this
    prefix = ""  # (after this optional tag)
    marker = ""  # or: calls start at this marker, after optional content

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def calls_rules(self, tools: list[ToolSpec], parallel: bool) -> str:
        """Lark rules whose rule ``calls`` is one call (several if ``parallel``) of one of
        ``tools`` with arguments valid for its schema (any JSON object if not ``strict``)."""
        raise NotImplementedError

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        """``tool_choice`` required / named: every sentence is calls (``calls_rules``)."""
        return "start: calls\n" + self.calls_rules(tools, parallel)

    def auto_grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        """``tool_choice`` auto: every sentence is either text that ``extract`` reads as no
        call, or calls as ``grammar`` writes them. Here: text whose stripped form does not
        start with ``starts_with``, or the calls from the first character."""
        return (f"start: TEXT | calls\nTEXT: {_not_starting_with(self.prefix, self.starts_with)}"
                "\n" + self.calls_rules(tools, parallel))


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """Complete blocks only: a last block cut by max_tokens is dropped."""
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text, start):
            try:
                call = _call_from_json(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not well-formed calls: the text stays content
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def calls_rules(self, tools: list[ToolSpec], parallel: bool) -> str:
        body = lark_json({"anyOf": [_object_schema(t, "arguments") for t in tools]})
        more = f" ({_lit(chr(10))} call)*" if parallel else ""
        return (f"calls: call{more}\n"
                f"call: {_lit(self.marker)} call_rest\n"
                f"call_rest: {_lit(chr(10))} body {_lit(chr(10) + '</tool_call>')}\n"
                f"body: {body}\n")

    def auto_grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        """Text without the marker (so every call goes through the grammar), or text up to
        the first marker (a lazy lexeme: it ends at the marker) and the calls from there. The
        text lexeme and the lazy one run side by side: a marker kills the first and ends the
        second, which a greedy lexer alone could not split."""
        more = f" ({_lit(chr(10))} call)*" if parallel else ""
        m = re.escape(self.marker)
        return (f"start: TEXT | text_call call_rest{more}\n"
                f"TEXT: /(?s:.*)/ & ~/(?s:.*{m}.*)/\n"
                f"text_call[lazy]: /(?s:.*){m}/\n"
                + self.calls_rules(tools, parallel))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    starts_with = "{"
    prefix = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        s = text.strip().removeprefix(self.prefix).strip()
        if not s.startswith("{"):
            return text, []
        dec, i, calls = json.JSONDecoder(), 0, []
        while i < len(s):
            try:
                obj, i = dec.raw_decode(s, i)
            except ValueError:
                return text, []
            call = _call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            while i < len(s) and s[i] in " \t\r\n;":
                i += 1
        return None, calls

    def calls_rules(self, tools: list[ToolSpec], parallel: bool) -> str:
        body = lark_json({"anyOf": [_object_schema(t, "parameters") for t in tools]})
        more = f" ({_lit('; ')} body)*" if parallel else ""
        return f"calls: body{more}\nbody: {body}\n"


_PY_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False,
                 "None": None}


def _py_value(node: ast.expr) -> object:
    if isinstance(node, ast.Name) and node.id in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values, strict=True)
                if k is not None}
    return ast.literal_eval(node)


class PythonicParser(ToolParser):
    name = "pythonic"
    starts_with = "["
    prefix = "<|python_start|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        s = text.strip().removeprefix(self.prefix).removesuffix("<|python_end|>").strip()
        if not (s.startswith("[") and s.endswith("]")):
            return text, []
        try:
            tree = ast.parse(s, mode="eval").body
            if not isinstance(tree, ast.List):
                return text, []
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or \
                        node.args:
                    return text, []
                args = {kw.arg: _py_value(kw.value) for kw in node.keywords if kw.arg}
                calls.append(ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return text, []
        return None, calls

    def calls_rules(self, tools: list[ToolSpec], parallel: bool) -> str:
        """Each call passes the required parameters, in the schema's order, as keyword
        arguments whose values are written as JSON (read back as Python literals); a tool
        that is not ``strict`` takes any keyword arguments with any JSON values."""
        rules, alts = [], []
        any_kw = f"KW {_lit('=')} any"
        if not all(t.strict for t in tools):
            rules += ["KW: /[A-Za-z_][A-Za-z0-9_]*/", f"any: {lark_json({})}"]
        for i, t in enumerate(tools):
            alts.append(f"t{i}")
            if not t.strict:
                rules.append(f"t{i}: {_lit(t.name + '(')} ({any_kw} ({_lit(', ')} {any_kw})*)? "
                             f"{_lit(')')}")
                continue
            props = t.parameters.get("properties") or {}
            req = [p for p in props if p in set(t.parameters.get("required") or [])]
            parts = []
            for j, p in enumerate(req):
                rules.append(f"t{i}_a{j}: {lark_json(props[p] or {})}")
                parts.append(f"{_lit(('' if j == 0 else ', ') + p + '=')} t{i}_a{j}")
            rules.append(f"t{i}: {_lit(t.name + '(')} {' '.join(parts)} {_lit(')')}")
        more = f" ({_lit(', ')} call)*" if parallel else ""
        return (f"calls: {_lit('[')} call{more} {_lit(']')}\ncall: {' | '.join(alts)}\n"
                + "\n".join(rules) + "\n")


def get_parser(name: str) -> ToolParser:
    parsers = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
               "pythonic": PythonicParser}
    if name not in parsers:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return parsers[name]()


class StreamingToolCalls:
    """One streamed choice: ``feed`` each text delta and get the content that can be sent now;
    ``finish`` gives the content held back (if it was no call after all) and the calls, read
    from the whole text as a non-streamed answer's are."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # the answer so far
        self.sent = 0  # characters of it sent as content
        self.holding = False  # a call has started: hold everything from here to the end

    def feed(self, delta: str) -> str:
        self.text += delta
        text, p = self.text, self.parser
        if self.holding:
            return ""
        if p.starts_with:
            if self.sent == 0:
                head = text.lstrip()
                if not head:
                    return ""  # leading whitespace: wait for the first real character
                if head.startswith(p.starts_with):
                    self.holding = True
                    return ""
            out, self.sent = text[self.sent:], len(text)
            return out
        at = text.find(p.marker, max(0, self.sent - len(p.marker)))
        if at >= 0:
            self.holding = True
            out, self.sent = text[self.sent:at], at
            return out
        safe = len(text)  # hold back a tail that could be the marker's beginning
        for k in range(min(len(p.marker) - 1, len(text)), 0, -1):
            if text.endswith(p.marker[:k]):
                safe = len(text) - k
                break
        safe = max(safe, self.sent)
        out, self.sent = text[self.sent:safe], safe
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        _, calls = self.parser.extract(self.text)
        if calls:
            return "", calls
        rest, self.sent = self.text[self.sent:], len(self.text)
        return rest, []
