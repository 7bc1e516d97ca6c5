"""``POST /v1/responses`` (OpenAI's Responses API for text models), ``GET`` / ``DELETE
/v1/responses/{id}``.

A Responses request becomes a chat completion request (``to_chat_request``): ``input`` items
become chat messages (``function_call`` items an assistant turn's ``tool_calls``,
``function_call_output`` items ``tool`` messages), ``instructions`` a system message in front,
``text.format`` a ``response_format``, function tools chat tools (``strict`` defaults to true,
as in OpenAI's Responses API). ``ResponsesHandler`` is a ``ChatHandler`` on it, so the chat
template, tool-call parsers, grammars and reasoning parser are the chat endpoint's; it answers
with a ``response`` object whose ``output`` holds a ``reasoning`` item (with
``--reasoning-parser``), a ``message`` item and ``function_call`` items, and streams the
documented events (``response.created`` ... ``response.completed``). ``store`` keeps the
answer and its conversation in the server's ``ResponseStore``; ``previous_response_id``
continues that conversation, so its rendered prompt starts with the earlier turns' tokens and
the prefix cache serves them (``usage.input_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from kvserve.http.errors import APIError, bad_request, loc_to_param
from kvserve.http.protocol import ChatCompletionRequest, ResponseFormatJSONObject
from kvserve.server.chat import ChatHandler
from kvserve.server.generation import ClientDisconnected, Generation
from kvserve.server.responses_protocol import (
    TEXT_PARTS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputMessage,
    ResponsesRequest,
    TextFormatJSONSchema,
)
from kvserve.server.state import ServerState
from kvserve.server.streaming import ChunkSource, Update

logger = logging.getLogger("kvserve.server")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def not_found(rid: str) -> APIError:
    return APIError(404, f"No response with id {rid!r} is stored on this server (never "
                    "stored, deleted, or evicted: see --responses-max-stored).",
                    param="response_id", code="response_not_found")


# ---- request -> chat ----------------------------------------------------------------------
def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's ``input`` as chat messages (the chat endpoint's JSON form)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for i, item in enumerate(body.input):
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _content_text(item.content, i)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        # reasoning items are not rendered (templates drop earlier turns' reasoning)
    return out


def _content_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        param = f"input[{index}].content[{j}]"
        if part.type not in TEXT_PARTS:
            raise bad_request(f"{param} has type {part.type!r}, which this text model's server "
                              "does not support; send input_text parts or a string", param,
                              "unsupported_content_type")
        if part.text is None:
            raise bad_request(f"{param} is a text part without its 'text' field", param)
        texts.append(part.text)
    return "\n".join(texts)


def to_chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    chat: dict = {"messages": messages, "stream": body.stream,
                  "parallel_tool_calls": body.parallel_tool_calls}
    for key, value in (("model", body.model), ("temperature", body.temperature),
                       ("top_p", body.top_p), ("seed", body.seed), ("user", body.user),
                       ("max_completion_tokens", body.max_output_tokens),
                       ("chat_template_kwargs", body.chat_template_kwargs)):
        if value is not None:
            chat[key] = value
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            **t.model_dump(exclude_none=True, exclude={"type", "strict"}),
            "strict": True if t.strict is None else t.strict}} for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, ResponseFormatJSONObject):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, TextFormatJSONSchema):
        chat["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            by_alias=True, exclude_none=True, exclude={"type"})}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # e.g. a function_call item whose arguments are not JSON
        err = e.errors()[0]
        loc = tuple(err.get("loc", ()))
        param = "input" if loc[:1] == ("messages",) else loc_to_param(("body", *loc))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise bad_request(f"{param}: {msg}", param) from e


# ---- output items ---------------------------------------------------------------------------
def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _status(reason: str | None) -> tuple[str, dict | None]:
    """(response status, incomplete_details) for a finish reason."""
    if reason in ("stop", "tool_calls"):
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if reason == "length" else None}


class ResponsesHandler(ChatHandler):
    id_prefix = "resp"
    operation = "chat"

    def __init__(self, body: ResponsesRequest, state: ServerState) -> None:
        self.body = body
        prior: list[dict] = []
        if body.previous_response_id is not None:
            entry = state.responses.get(body.previous_response_id)
            if entry is None:
                raise APIError(404, f"previous response {body.previous_response_id!r} is not "
                               "stored on this server (never stored, deleted, or evicted)",
                               param="previous_response_id",
                               code="previous_response_not_found")
            prior = list(entry.messages)
        self.history = prior + input_messages(body)  # what a continuation starts from
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        super().__init__(to_chat_request(body, system + self.history), state)
        self.events = response_events  # an instance attribute: not bound as a method

    # ---- the response object -------------------------------------------------------------
    def response_object(self, gen: Generation, output: list[dict], status: str,
                        incomplete: dict | None, usage: dict | None) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        choice = b.tool_choice
        return {
            "id": gen.request_id, "object": "response", "created_at": gen.created,
            "status": status, "error": None, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id, "reasoning": None,
            "store": b.store, "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "tool_choice": (choice.model_dump() if isinstance(choice, FunctionToolChoice)
                            else choice or ("auto" if b.tools else "none")),
            "tools": [{**t.model_dump(exclude_none=True),
                       "strict": True if t.strict is None else t.strict}
                      for t in b.tools or []],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": b.truncation or "disabled", "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }

    def usage(self, gen: Generation) -> dict:
        p, c = gen.num_prompt_tokens, gen.num_generated_tokens
        comp = gen.completion(0, 0)
        thinking = 0
        if self.reasoning is not None and comp is not None and comp.token_ids and \
                self.split(comp.text)[0] is not None:
            end = self.reasoning.end_token_id
            ids = comp.token_ids
            thinking = ids.index(end) + 1 if end in ids else len(ids)
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens":
                                                            gen.num_cached_tokens},
                "output_tokens": c, "output_tokens_details": {"reasoning_tokens": thinking},
                "total_tokens": p + c}

    def finish(self, gen: Generation, output: list[dict], reason: str | None) -> dict:
        """The final response object; stored (with its conversation) when ``store``."""
        status, incomplete = _status(reason)
        response = self.response_object(gen, output, status, incomplete, self.usage(gen))
        if self.body.store:
            text = "".join(p["text"] for it in output if it["type"] == "message"
                           for p in it["content"])
            reply: dict = {"role": "assistant", "content": text}
            calls = [{"id": it["call_id"], "type": "function", "function": {
                "name": it["name"], "arguments": it["arguments"]}}
                for it in output if it["type"] == "function_call"]
            if calls:
                reply["tool_calls"] = calls
            self.state.responses.put(gen.request_id, response, [*self.history, reply])
        return response

    # ---- answers ---------------------------------------------------------------------------
    def full(self, gen: Generation) -> dict:
        comp = gen.completion(0, 0)
        reason = gen.finish_reason(comp)
        reasoning, text = self.split(comp.text) if comp is not None else (None, "")
        calls = []
        if self.parser is not None and comp is not None:
            content, found = self.parser.extract(text)
            if found:
                text, calls = content or "", found
                reason = "tool_calls" if reason == "stop" else reason
        status = "completed" if _status(reason)[0] == "completed" else "incomplete"
        output = []
        if reasoning is not None:
            output.append(reasoning_item(_new_id("rs"), reasoning, status))
        if text or not calls:
            output.append(message_item(_new_id("msg"), text, status))
        output += [call_item(_new_id("fc"), f"call_{uuid.uuid4().hex[:24]}", c.name,
                             c.arguments, status) for c in calls]
        return self.finish(gen, output, reason)

    async def chunks(self, gen: Generation, first: Update | None) -> AsyncIterator[dict]:
        """The Responses events, translated from the chat endpoint's chunks (one choice)."""
        seq = itertools.count()

        def ev(kind: str, **fields) -> dict:
            return {"type": kind, "sequence_number": next(seq), **fields}

        start = self.response_object(gen, [], "in_progress", None, None)
        yield ev("response.created", response=start)
        yield ev("response.in_progress", response=start)
        output: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item being streamed
        text = ""
        calls: list[dict] = []
        reason = None

        def close(status: str):
            nonlocal open_item, text
            item, open_item = open_item, None
            k = len(output)
            if item["type"] == "reasoning":
                done = reasoning_item(item["id"], text, status)
                yield ev("response.reasoning_text.done", item_id=item["id"], output_index=k,
                         content_index=0, text=text)
            else:
                done = message_item(item["id"], text, status)
                yield ev("response.output_text.done", item_id=item["id"], output_index=k,
                         content_index=0, text=text, logprobs=[])
                yield ev("response.content_part.done", item_id=item["id"], output_index=k,
                         content_index=0, part=text_part(text))
            yield ev("response.output_item.done", output_index=k, item=done)
            output.append(done)
            text = ""

        def open_(kind: str):
            nonlocal open_item
            k = len(output)
            if kind == "reasoning":
                open_item = reasoning_item(_new_id("rs"), "", "in_progress")
                open_item["content"] = []
                yield ev("response.output_item.added", output_index=k, item=open_item)
            else:
                open_item = message_item(_new_id("msg"), None, "in_progress")
                yield ev("response.output_item.added", output_index=k, item=open_item)
                yield ev("response.content_part.added", item_id=open_item["id"],
                         output_index=k, content_index=0, part=text_part(""))

        async for chunk in super().chunks(gen, first):
            for ch in chunk["choices"]:
                d = ch["delta"]
                for kind, delta in (("reasoning", d.get("reasoning_content")),
                                    ("message", d.get("content"))):
                    if not delta:
                        continue
                    if open_item is not None and open_item["type"] != kind:
                        for e in close("completed"):
                            yield e
                    if open_item is None:
                        for e in open_(kind):
                            yield e
                    text += delta
                    name = ("response.reasoning_text.delta" if kind == "reasoning"
                            else "response.output_text.delta")
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    yield ev(name, item_id=open_item["id"], output_index=len(output),
                             content_index=0, delta=delta, **extra)
                calls += d.get("tool_calls") or []
                reason = ch.get("finish_reason") or reason
        status = "completed" if _status(reason)[0] == "completed" else "incomplete"
        if open_item is not None and open_item["type"] == "reasoning":
            for e in close(status):
                yield e
        if open_item is None and not calls and not any(it["type"] == "message"
                                                       for it in output):
            for e in open_("message"):
                yield e
        if open_item is not None:
            for e in close(status):
                yield e
        for c in calls:
            k = len(output)
            item = call_item(_new_id("fc"), c["id"], c["function"]["name"], "", "in_progress")
            yield ev("response.output_item.added", output_index=k, item=item)
            args = c["function"]["arguments"]
            yield ev("response.function_call_arguments.delta", item_id=item["id"],
                     output_index=k, delta=args)
            yield ev("response.function_call_arguments.done", item_id=item["id"],
                     output_index=k, name=item["name"], arguments=args)
            item = {**item, "arguments": args, "status": status}
            yield ev("response.output_item.done", output_index=k, item=item)
            output.append(item)
        response = self.finish(gen, output, reason)
        kind = "response.completed" if response["status"] == "completed" else \
            "response.incomplete"
        yield ev(kind, response=response)


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def response_events(gen: Generation, first: Update | None,
                          chunks: ChunkSource) -> AsyncIterator[str]:
    """A Responses stream: ``event: TYPE`` + ``data: {...}`` per event, no ``[DONE]``; a
    failure after the headers is an ``error`` event (OpenAI's shape: code, message, param)."""
    seq = 0
    try:
        async for event in chunks(gen, first):
            seq = event["sequence_number"] + 1
            yield _sse(event)
    except ClientDisconnected:
        return
    except APIError as e:
        yield _sse({"type": "error", "sequence_number": seq, "code": e.code or e.type,
                    "message": e.message, "param": e.param})
    except Exception:  # noqa: BLE001 - headers are sent: the stream ends with an error event
        logger.exception("stream %s failed", gen.request_id)
        yield _sse({"type": "error", "sequence_number": seq, "code": "internal_error",
                    "message": "internal error", "param": None})
    finally:
        gen.close()
