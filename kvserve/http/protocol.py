"""OpenAI-compatible request and response models (pydantic 2).

Requests ignore unknown fields (``extra="ignore"``), are strictly typed as OpenAI's API is (no
coercion of ``"yes"`` to a bool or ``true`` to a token id), reject NaN / infinity and strings
with lone surrogates, and limit chat roles to OpenAI's five. Bounds that do
not depend on the served model live here as ``Field`` constraints, so they show up in the
OpenAPI schema; bounds that do (context length, vocabulary, ``n``) are checked when serving.
Fields marked *kvserve* are extensions beyond OpenAI's API (vLLM spells them the same way).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema

from kvserve.sampling_params import MAX_LOGPROBS

MAX_STOP_SEQUENCES = 16
# the largest seed: what a float64 (which JSON schema validators and JavaScript clients read
# numbers as) holds exactly, so no larger integer compares equal to it
MAX_SEED = 2**53 - 1
SURROGATE_MESSAGE = "contains an unpaired UTF-16 surrogate (not valid Unicode)"


def first_surrogate(value: str) -> int | None:
    """Index of the first lone surrogate in ``value`` (JSON ``"\\ud800"`` decodes to one).
    Fast on multi-megabyte prompts: ASCII is checked in C, anything else is encoded once."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _valid_unicode(value: str) -> str:
    i = first_surrogate(value)
    if i is not None:
        raise ValueError(f"{SURROGATE_MESSAGE} at character {i}")
    return value


# Every string a request carries is valid Unicode: it is tokenized, hashed or echoed back.
Text = Annotated[str, AfterValidator(_valid_unicode)]


def _integral(value: Any) -> Any:
    """JSON's ``2.0`` is the integer 2 (JSON Schema's ``integer`` admits it): a float with no
    fraction becomes that int; anything else (a bool, a string) is left to strict validation."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A request's integer: strict (no bools, no strings), but 2.0 is 2.
Int = Annotated[int, BeforeValidator(_integral)]


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(schema: dict[str, Any], _: Any = None) -> None:
    """An ``Int | None`` field's bounds, which pydantic leaves as ``ge`` / ``le`` (the
    before-validator hides them), spelled as JSON Schema spells them."""
    for prop in schema.get("properties", {}).values():
        for node in (prop, *prop.get("anyOf", ())):
            for key, std in _BOUNDS.items():
                if key in node:
                    node[std] = node.pop(key)


class _Request(BaseModel):
    # strict: types as OpenAI's API defines them ("stream": "yes", "echo": 0 or
    # "prompt": [true] are errors, not coerced); floats still accept integers, and integers
    # integral floats (Int).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True,
                              json_schema_extra=_standard_bounds)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- requests ---------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
JsonSchema = dict[str, Any]


class JSONSchemaFormat(_Request):
    name: ToolName = Field(..., description="The schema's name (letters, digits, _ and -).")
    description: Text | None = None
    schema_: JsonSchema = Field(..., alias="schema", description="A JSON schema.")
    strict: bool | None = Field(None, description="true: every object in the schema forbids "
                                                  "undeclared properties, whatever its "
                                                  "additionalProperties says.")
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True,
                              populate_by_name=True)


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJSONObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


def type_tag(value: Any, tags: dict[str, str], default: str | None = None) -> str | None:
    """The union tag of a tagged-union member (a dict or a model) by its ``type``; None (no
    member fits) when the type is not one of ``tags``, or not a string at all."""
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type",
                                                                               None)
    return tags.get(kind) if isinstance(kind, str) else None


def _format_tag(value: Any) -> str | None:
    return type_tag(value, {"text": "Text", "json_object": "JSONObject",
                            "json_schema": "JSONSchema"})


def output_format(json_schema: type[BaseModel]) -> Any:
    """The union of ``{"type": "text"}``, ``{"type": "json_object"}`` and ``json_schema``'s
    model (typed ``"json_schema"``), told apart by ``type``; the tags are class-like so that
    error locations skip them (kvserve.http.errors)."""
    return Annotated[
        Annotated[ResponseFormatText, Tag("Text")]
        | Annotated[ResponseFormatJSONObject, Tag("JSONObject")]
        | Annotated[json_schema, Tag("JSONSchema")],
        Discriminator(_format_tag, custom_error_type="response_format_type",
                      custom_error_message="type must be 'text', 'json_object' or "
                                           "'json_schema'")]


# chat / completions: {"type": "json_schema", "json_schema": {...}}
ResponseFormat = output_format(ResponseFormatJSONSchema)


def _exactly_one(schema: dict[str, Any], cls: Any = None) -> None:
    """The schema of ``StructuredOutputsRequest``: exactly one field, not null (nor
    ``json_object: false``), as ``kvserve.sampling_params.StructuredOutputsParams`` checks."""
    _standard_bounds(schema)
    for name, prop in schema["properties"].items():
        branches = [b for b in prop.pop("anyOf", [prop]) if b.get("type") != "null"]
        prop.pop("default", None)
        prop.update(branches[0] if len(branches) == 1 else {"anyOf": branches})
        if name == "json_object":
            prop["const"] = True
    schema["oneOf"] = [{"required": [name]} for name in schema["properties"]]


class StructuredOutputsRequest(_Request):
    """kvserve (vLLM's ``structured_outputs``): exactly one of these."""

    json_: JsonSchema | Text | None = Field(None, alias="json", description="A JSON schema.")
    json_object: bool | None = None
    regex: Text | None = Field(None, min_length=1)
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = Field(None, min_length=1, description="Lark, or GBNF (::=).")
    model_config = ConfigDict(populate_by_name=True, json_schema_extra=_exactly_one)


class FirstTokenIn(_Request):
    id: Int = Field(ge=0)
    logprob: float = 0.0
    # [[token id, logprob], ...]
    top_logprobs: list[list[float]] | None = Field(None, max_length=MAX_LOGPROBS + 1)


class KVTransferLeg(_Request):
    """kvserve router -> replica: one leg of a disaggregated request (kvserve/server/disagg.py)."""

    role: Literal["prefill", "decode"]
    handle: dict[str, Any] | None = None  # kvserve.cache.kv_transfer.TransferHandle.to_dict()
    first_token: FirstTokenIn | None = None
    # the prefill leg's trace context (W3C traceparent), when it was traced
    traceparent: str | None = Field(None, max_length=64)
    # prompt tokens the prefill replica's prefix cache served (the decode leg's usage reports it)
    cached_tokens: Int | None = Field(None, ge=0)


class SamplingRequest(_Request):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: Text | None = Field(None, description="Must name the served model when given.")
    n: Int = Field(1, ge=1, description="Choices per prompt (capped by the server's --max-n).")
    temperature: float | None = Field(None, ge=0, le=2, description="Default 1.0; 0 = greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = Field(None, description="Up to 16 stop strings.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="Accepted and ignored.")

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, value: Any, handler: Any) -> Any:
        _check_strings(value, "stop")
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("stop must be a string or a list of strings") from None
    # kvserve extensions
    top_k: Int | None = Field(None, ge=-1, description="kvserve: -1 or 0 disables.")
    min_p: float | None = Field(None, ge=0, le=1, description="kvserve.")
    repetition_penalty: float | None = Field(None, gt=0, le=2, description="kvserve.")
    ignore_eos: bool = Field(False, description="kvserve: keep generating past EOS.")
    min_tokens: Int = Field(0, ge=0, description="kvserve: no stop before this many tokens.")
    priority: Int = Field(0, description="kvserve: lower runs first (--scheduling-policy "
                                         "priority).")
    cache_salt: Text | None = Field(None, max_length=256,
                                   description="kvserve: isolates prefix-cache sharing.")
    response_format: ResponseFormat | None = Field(
        None, description="Constrain the output to JSON (docs/structured-outputs.md).")
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="kvserve (as vLLM): json / json_object / regex / choice / grammar.")
    # the router's own leg of a disaggregated request (docs/disaggregation.md), not the API's:
    # left out of the published schema
    kv_transfer: SkipJsonSchema[KVTransferLeg | None] = Field(
        None, description="kvserve router: a prefill / decode leg (docs/disaggregation.md).")


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Int], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)] = Field(
            ..., description="Text, token ids, or a batch of either (nothing empty).")
    max_tokens: Int | None = Field(16, ge=1, description="None: up to the context length.")
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> Any:
        _check_strings(value, "prompt")
        if isinstance(value, list) and len(value) > 1:
            for i, item in enumerate(value):
                if isinstance(item, str | list) and not item:
                    raise ValueError(f"prompt[{i}] must not be empty")
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists, none of them empty") from None


def _check_strings(value: Any, param: str) -> None:
    """A lone surrogate in a string (or a list of strings) is named precisely, before a union's
    generic shape message could hide it."""
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for k, item in enumerate(items):
        if isinstance(item, str) and (i := first_surrogate(item)) is not None:
            where = param if isinstance(value, str) else f"{param}[{k}]"
            raise ValueError(f"{where} {SURROGATE_MESSAGE} at character {i}")


def _text_part(schema: dict[str, Any], cls: Any = None) -> None:
    _standard_bounds(schema)
    schema["properties"]["text"] = {"type": "string"}  # a text part's text: required
    schema["required"] = ["type", "text"]


class ContentPart(_Request):
    """Only ``"text"`` parts with their text are served (the schema says so); other types get
    a 400 naming the type (``unsupported_content_type``)."""

    model_config = ConfigDict(json_schema_extra=_text_part)
    type: Text = Field(..., max_length=64, json_schema_extra={"enum": ["text"]})
    text: Text | None = None


Content = Text | list[ContentPart]


class _Message(_Request):
    content: Content | None = None
    name: Text | None = Field(None, max_length=256)


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class FunctionCall(_Request):
    name: ToolName
    arguments: Text = Field(..., description="The arguments as a JSON object's text.")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        import json

        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("arguments must be a JSON object's text") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object's text")
        return value


class ToolCall(_Request):
    id: Text = Field(..., min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class AssistantMessageIn(_Message):
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Request):
    role: Literal["tool"]
    content: Content = Field(..., description="The tool's result.")
    tool_call_id: Text = Field(..., min_length=1, max_length=256)
    name: Text | None = Field(None, max_length=256)


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessageIn | ToolMessage,
                        Field(discriminator="role")]


# a function's parameters: an object's JSON schema (``type`` "object" or left out)
OBJECT_SCHEMA = {"properties": {"type": {"const": "object"}}}


class FunctionDefinition(_Request):
    name: ToolName
    description: Text | None = None
    parameters: JsonSchema | None = Field(None, description="A JSON schema (an object's).",
                                          json_schema_extra=OBJECT_SCHEMA)
    strict: bool | None = Field(None, description="tool_choice auto: this tool's arguments "
                                                  "follow its parameters schema (a grammar); "
                                                  "required / named always do.")


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: ToolName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


# a tool_choice other than "none" needs tools (kvserve/server/structured.py ``tool_plan``)
TOOLS_NEEDED = {"if": {"required": ["tool_choice"],
                       "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}},
                "then": {"required": ["tools"],
                         "properties": {"tools": {"type": "array", "minItems": 1}}}}


def _tool_schema(schema: dict[str, Any], cls: Any = None) -> None:
    _standard_bounds(schema)
    schema.setdefault("allOf", []).append(TOOLS_NEEDED)


def _chat_schema(schema: dict[str, Any], cls: Any = None) -> None:
    _tool_schema(schema)
    # top_logprobs needs logprobs: true (kvserve/server/chat.py refuses it without)
    schema["allOf"].append({
        "if": {"required": ["top_logprobs"],
               "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra=_chat_schema)

    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[ChatTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool = True
    max_tokens: Int | None = Field(None, ge=1, description="Deprecated by OpenAI; "
                                                           "max_completion_tokens wins.")
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = Field(True, description="kvserve.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="kvserve (as vLLM): extra variables for the chat template, e.g. "
                          "{\"enable_thinking\": false}.")


# ---- responses --------------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (docs/server.md)


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# abort: cut by a forced server shutdown; grammar_dead_end: a structured output's grammar
# allowed no next token
FinishReason = Literal["stop", "length", "abort", "tool_calls", "grammar_dead_end"]


LogprobsT = TypeVar("LogprobsT", bound=BaseModel)
ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Choice(_Response, Generic[LogprobsT]):
    """What every choice carries besides its ``text``, ``message`` or ``delta``."""

    index: int
    logprobs: LogprobsT | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class _Completion(_Response, Generic[ChoiceT]):
    """What every answer (a text or chat completion, or a chunk of one) carries; ``object`` is
    the kind's literal."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class CompletionChoice(_Choice[CompletionLogprobs]):
    text: str


class CompletionResponse(_Completion[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the model's reasoning
    tool_calls: list[ToolCallOut] | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(_Choice[ChoiceLogprobs]):
    message: AssistantMessage


class ChatCompletionResponse(_Completion[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Choice[ChoiceLogprobs]):
    delta: DeltaMessage


class ChatCompletionChunk(_Completion[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter: the folder it was loaded from
    parent: str | None = None  # a LoRA adapter: the served base model


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: Text = Field(min_length=1, max_length=256)
    lora_path: Text = Field(min_length=1, max_length=4096,
                            description="a PEFT LoRA folder on the server's disk")


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted, unused)."""

    lora_name: Text = Field(min_length=1, max_length=256)
    lora_int_id: Int | None = None


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
