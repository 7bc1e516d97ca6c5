"""``StructuredOutputsParams``: what a request's output must follow (vLLM's class of that name;
``SamplingParams.structured_outputs`` holds one, and ``kvserve.sampling_params`` re-exports it).
Validated here; its ``key`` names the compiled grammar in the compiler's cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, dict or JSON text), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of these strings) or ``grammar`` (Lark, or GBNF as llama.cpp writes it).
    The engine compiles it (``compiler.GrammarCompiler``) and masks every sampled token with
    it."""

    json: str | dict[str, Any] | None = None  # stored as canonical JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # kvserve: JSON whitespace. False writes compact JSON (", " and ": " separators, no
    # newlines), which keeps small models from spending their budget on indentation.
    whitespace_flexible: bool = False
    # kvserve: a reasoning model's answer (docs/server.md, "Reasoning models"): the grammar
    # applies only after the reasoning, which ends with the token reasoning_end_token_id.
    # reasoning_state says where the answer starts: "reasoning" (inside it: the grammar starts
    # after the end token), "undecided" (reasoning if the first token is
    # reasoning_start_token_id, else the grammar applies from the first token), None (no
    # reasoning: the grammar applies from the first token). Not part of the compiled grammar.
    reasoning_start_token_id: int | None = None
    reasoning_end_token_id: int | None = None
    reasoning_state: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_state not in (None, "reasoning", "undecided"):
            raise ValueError("reasoning_state must be None, 'reasoning' or 'undecided', got "
                             f"{self.reasoning_state!r}")
        if self.reasoning_state is not None and self.reasoning_end_token_id is None:
            raise ValueError("reasoning_state needs reasoning_end_token_id")
        if self.reasoning_state == "undecided" and self.reasoning_start_token_id is None:
            raise ValueError("reasoning_state 'undecided' needs reasoning_start_token_id")
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None:  # kept as compact JSON text (hashable; key order kept)
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"json must be a JSON schema: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("json must be a JSON schema (an object)")
            try:
                text = json.dumps(schema, separators=(",", ":"),
                                  allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"json must be a JSON schema: {e}") from None
            object.__setattr__(self, "json", text)
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """The compiled-grammar cache key: (kind, canonical text, whitespace)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            value = json.dumps(value)
        return self.kind, str(value), self.whitespace_flexible
