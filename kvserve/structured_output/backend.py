"""The backend: llguidance (chosen over xgrammar: docs/structured-outputs.md, "Backend choice").
What is written in its dialect lives here: ``StructuredOutputsParams`` -> grammar text (Lark, or
llguidance's JSON-schema form), the compact JSON layout every JSON grammar uses, and the Lark
pieces the tool-call grammars are written with (``lark_literal``, ``lark_json``)."""

from __future__ import annotations

import json

from kvserve.structured_output.params import StructuredOutputsParams

# JSON written compactly (", " and ": ", no newlines) unless whitespace_flexible: the structured
# outputs' JSON and the tool calls' arguments alike
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def load_llguidance():
    """The llguidance module (ValueError when it is missing)."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # pragma: no cover - a dependency of kvserve
        raise ValueError("structured outputs need the llguidance package "
                         "(pip install llguidance)") from e
    return llguidance


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (Lark, or llguidance's JSON form) for ``so``."""
    llg = load_llguidance()
    m = llg.LLMatcher
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = json.loads(so.json) if kind == "json" else {"type": "object"}
        opts = {"whitespace_flexible": True} if so.whitespace_flexible else dict(COMPACT_JSON)
        try:
            return m.grammar_from_json_schema(schema, defaults=opts)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        return m.grammar_from_regex(so.regex)
    if kind == "choice":
        assert so.choice
        return "start: " + " | ".join(json.dumps(c) for c in so.choice)
    assert kind == "grammar" and so.grammar is not None
    if "::=" in so.grammar:  # GBNF (llama.cpp); Lark uses ':'
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return m.grammar_from_lark(gbnf_to_lark(so.grammar))
        except Exception as e:  # noqa: BLE001 - the converter raises its own error types
            raise ValueError(f"invalid GBNF grammar: {e}") from None
    return m.grammar_from_lark(so.grammar)


def lark_literal(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def lark_json(schema: dict) -> str:
    """A Lark rule body: JSON valid for ``schema``, written compactly (as the JSON structured
    outputs are), through llguidance's ``%json`` extension."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})
