"""``POST /v1/responses`` request models (OpenAI's Responses API, text models): pydantic 2,
typed strictly as ``kvserve.http.protocol``'s requests are. What a text model cannot serve
(images, files, hosted tools) is refused with a 400 naming the field; fields that change
nothing here (``reasoning``, ``include``, ``truncation``) are accepted."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from kvserve.http.protocol import (
    MAX_SEED,
    ContentPart,
    FunctionDefinition,
    Int,
    JSONSchemaFormat,
    NamedFunction,
    Text,
    ToolName,
    _Request,
    _Response,
    _tool_schema,
    output_format,
    type_tag,
)


class _Item(_Request):
    """What every input item may carry (an earlier response's item echoed back)."""

    id: Text | None = None
    status: Text | None = None


TEXT_PARTS = ("input_text", "output_text", "text")


class InputContentPart(ContentPart):
    type: Text = Field(..., max_length=64, json_schema_extra={"enum": list(TEXT_PARTS)})


class InputMessage(_Item):
    """A message item (``type`` "message" or absent: OpenAI's EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputContentPart]


class _CallItem(_Item):
    call_id: Text = Field(..., min_length=1, max_length=256)


class FunctionCallItem(_CallItem):
    """A call the model made (an earlier response's ``function_call`` output item)."""

    type: Literal["function_call"]
    name: ToolName
    arguments: Text


class FunctionCallOutputItem(_CallItem):
    """A tool's result for ``call_id``."""

    type: Literal["function_call_output"]
    output: Text


class ReasoningItem(_Request):
    """An earlier response's reasoning item: accepted and not rendered (as chat templates
    drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: Text | None = None


def _item_tag(value: Any) -> str | None:
    return type_tag(value, {"message": "Message", "function_call": "FunctionCall",
                            "function_call_output": "FunctionCallOutput",
                            "reasoning": "Reasoning"}, default="message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(_item_tag, custom_error_type="input_item_type",
                  custom_error_message="type must be 'message', 'function_call', "
                                       "'function_call_output' or 'reasoning'")]


class FunctionTool(FunctionDefinition):
    """Chat's ``function`` object, flattened into the tool."""

    type: Literal["function"]
    strict: bool | None = Field(None, description="Default true (as OpenAI's Responses API): "
                                                  "the arguments follow the schema, every "
                                                  "object closed.")


class FunctionToolChoice(NamedFunction):
    type: Literal["function"]


class TextFormatJSONSchema(JSONSchemaFormat):
    """``text.format``'s JSON schema: chat's ``json_schema`` object, flattened."""

    type: Literal["json_schema"]


TextFormat = output_format(TextFormatJSONSchema)


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model_config = ConfigDict(json_schema_extra=_tool_schema)

    model: Text | None = Field(None, description="Must name the served model when given.")
    input: Text | Annotated[list[InputItem], Field(min_length=1)] = Field(
        ..., description="A user message's text, or input items (messages, function_call, "
                         "function_call_output).")
    instructions: Text | None = Field(None, description="A system message before the input "
                                                        "(not carried to continuations).")
    previous_response_id: Text | None = Field(None, description="Continue a stored response's "
                                                                "conversation.")
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = Field(True, description="Keep the response for GET and continuations "
                                          "(bounded: --responses-max-stored / -bytes).")
    metadata: dict[str, Text] | None = Field(None, max_length=16)
    user: Text | None = None
    reasoning: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = Field(None, description="Accepted and ignored.")
    # kvserve extensions
    seed: Int | None = Field(None, ge=0, le=MAX_SEED, description="kvserve.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="kvserve.")


# ---- responses (for the OpenAPI schema; the handler builds them as dicts) --------------------
class ResponseObject(_Response):
    """OpenAI's ``response`` object: ``output`` holds ``reasoning``, ``message`` and
    ``function_call`` items."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class DeletedResponse(_Response):
    id: str
    object: Literal["response"] = "response"
    deleted: bool
