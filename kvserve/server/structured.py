"""Structured outputs and tools on the HTTP side: ``response_format`` / ``structured_outputs``
and ``tools`` / ``tool_choice`` -> the engine's ``StructuredOutputsParams`` (compiled off the
event loop, a compile error is a 400 naming the field) and the tool-call parser that reads the
answer back. docs/structured-outputs.md.

``tool_choice``: ``none`` renders the tools but parses no calls; ``auto`` (the default with
tools) parses calls the model chose to write, and when a tool is ``strict`` constrains the
answer to either text with no call in it or calls of declared tools whose strict ones'
arguments are valid for their schemas (``ToolParser.auto_grammar``; without a strict tool no
grammar is attached); ``required`` and a named function constrain the answer with the
parser's grammar, so it is always calls (one for a named function, several if
``parallel_tool_calls``) of declared tools with arguments valid for their schemas.

``strict: true`` (a ``json_schema`` response format, a function tool, a Responses
``text.format``) closes every object of the schema (``kvserve.structured_output.schema``).
What a grammar is, how it compiles and masks: kvserve/structured_output/; this module only
translates the request into its ``StructuredOutputsParams``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvserve.http.errors import bad_request
from kvserve.http.protocol import ChatCompletionRequest, SamplingRequest
from kvserve.server.settings import ServerSettings
from kvserve.server.tool_parsers import ToolParser, ToolSpec, get_parser
from kvserve.structured_output.params import StructuredOutputsParams
from kvserve.structured_output.schema import strict_schema

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Constraint:
    params: StructuredOutputsParams
    param: str  # the request field it came from (named by a compile error's 400)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    template_tools: list[dict] | None  # what the chat template gets (transformers' tools=)
    parser: ToolParser | None  # None: the answer is not parsed for calls
    constraint: Constraint | None  # required / named: the calls' grammar; auto: text or calls
    forced: bool = False  # required / named: the answer is calls (no room for a format)


def _so(param: str, **kw) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**kw), param)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from e


def output_constraint(req: SamplingRequest) -> Constraint | None:
    """The grammar that ``response_format`` or ``structured_outputs`` asks for, if any."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise bad_request("give response_format or structured_outputs, not both",
                          "structured_outputs")
    if rf is not None and rf.type == "json_object":
        return _so("response_format", json_object=True)
    if rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        if rf.json_schema.strict:
            schema = strict_schema(schema)
        return _so("response_format.json_schema.schema", json=schema)
    if so is None:
        return None
    return _so("structured_outputs", json=so.json_, json_object=bool(so.json_object),
               regex=so.regex, choice=so.choice, grammar=so.grammar)


def tool_plan(req: ChatCompletionRequest, settings: ServerSettings) -> ToolPlan:
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan(None, None, None)
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}] repeats the function name {name!r}",
                              f"tools[{i}].function.name")
    for i, t in enumerate(tools):
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise bad_request("a function's parameters must be an object's JSON schema",
                              f"tools[{i}].function.parameters")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    if settings.tool_call_parser is None:
        raise bad_request("this server parses no tool calls: start it with --tool-call-parser "
                          "(hermes, llama3_json, pythonic), or send tool_choice 'none'", "tools")
    parser = get_parser(settings.tool_call_parser)
    auto = choice == "auto"
    if auto and not any(t.function.strict for t in tools):
        return ToolPlan(template_tools, parser, None)  # the calls are read as written
    if auto or choice == "required":
        chosen, parallel = tools, req.parallel_tool_calls
    else:
        assert not isinstance(choice, str)
        want = choice.function.name
        chosen = [t for t in tools if t.function.name == want]
        if not chosen:
            raise bad_request(f"tool_choice names the function {want!r}, which is not in "
                              f"tools ({', '.join(names)})", "tool_choice")
        parallel = False
    # required / named: every tool's arguments follow its schema; auto: the strict ones'
    specs = [ToolSpec(t.function.name, _tool_schema(t.function.parameters, t.function.strict),
                      not auto or bool(t.function.strict)) for t in chosen]
    grammar = (parser.auto_grammar if auto else parser.grammar)(specs, parallel)
    return ToolPlan(template_tools, parser, _so("tools", grammar=grammar), forced=not auto)


def _tool_schema(parameters: dict | None, strict: bool | None) -> dict:
    schema = parameters or _EMPTY_OBJECT
    return strict_schema(schema) if strict else schema  # type: ignore[return-value]


async def compile_constraint(engine, constraint: Constraint | None) -> None:
    """Compile (or find cached) in a thread, so a slow grammar never blocks the event loop;
    the engine's ``add_request`` then hits the cache. A 400 naming the field if it fails."""
    if constraint is None:
        return
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, engine.compile_grammar, constraint.params)
    except ValueError as e:
        raise bad_request(f"{constraint.param}: {e}", constraint.param,
                          "invalid_grammar") from e
