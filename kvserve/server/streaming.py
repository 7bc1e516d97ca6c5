"""Answer a ``Generation`` as one JSON response or as a server-sent-event stream; ``Handler``,
what the completion and chat endpoints share from a request's body to its answer.

Both paths first wait for the request's first output, so admission, engine rejections and a
deadline that passes before any token all still become proper HTTP errors. A stream's
``Generation`` is closed in the response's own ``finally``, which runs when the stream ends,
when the client disconnects (Starlette cancels the body iterator) and when sending fails.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.http.errors import APIError, SafeJSONResponse, error_body
from kvserve.http.middleware import CLIENT_CLOSED, GENERATION_KEY
from kvserve.http.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
    dump,
)
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.generation import (
    ClientDisconnected,
    Generation,
    new_generation,
    run_to_first,
)
from kvserve.server.prompts import Prompt
from kvserve.server.state import ServerState
from kvserve.server.structured import Constraint

Update = tuple[int, RequestOutput]
ChunkSource = Callable[[Generation, Update | None], AsyncIterator[dict]]
# (choice index, prompt index, the choice's delta or None when cut short, finish reason) ->
# the chunk to send, or None for nothing
ChoiceChunk = Callable[[int, int, CompletionOutput | None, str | None], dict | None]

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

logger = logging.getLogger("kvserve.server")


class ChunkEnvelope:
    """A stream's chunks as dicts: the response's own fields (``id``, ``object``, ``created``,
    ``model``) dumped once, then per chunk only its choices and usage. Equal to dumping
    ``response(..., choices=choices, usage=usage)`` whole, without building and dumping that
    model for every token on the event loop (docs/server.md "Served vs offline")."""

    __slots__ = ("_base", "_with_usage")

    def __init__(self, response: type[CompletionResponse | ChatCompletionChunk], gen: Generation,
                 model: str, with_usage: bool) -> None:
        self._base = dump(response(id=gen.request_id, created=gen.created, model=model,
                                   choices=[]))
        self._with_usage = with_usage
        if not with_usage:
            self._base.pop("usage", None)

    def __call__(self, choices: list[dict], usage: UsageInfo | None = None) -> dict:
        d = {**self._base, "choices": choices}  # "choices" keeps its place among the keys
        if self._with_usage:
            d["usage"] = None if usage is None else dump(usage)
        return d


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class GenerationStream(StreamingResponse):
    """The SSE response of a ``Generation``. It streams without Starlette's disconnect
    listener (below ASGI 2.4 Starlette runs the body in an anyio task group beside a task
    awaiting ``receive``, which costs the event loop CPU on every chunk): the generation's
    own watcher (``Generation.start``) stays on instead, and a disconnect ends the body at
    the generation's next output (``ClientDisconnected``) as it ends a non-streamed one."""

    def __init__(self, content: AsyncIterator[str], gen: Generation) -> None:
        super().__init__(content, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # ASGI 2.4: sending failed, the client is gone
            pass
        finally:
            self._gen.close()


def usage(gen: Generation) -> UsageInfo:
    """OpenAI's usage, with ``prompt_tokens_details.cached_tokens`` (``Generation``'s
    ``num_cached_tokens``)."""
    p, c = gen.num_prompt_tokens, gen.num_generated_tokens
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=gen.num_cached_tokens))


def full_response(gen: Generation, response: type[CompletionResponse | ChatCompletionResponse],
                  model: str, choices: list) -> dict:
    """The one-JSON answer: ``response`` of ``choices`` with the usage, plus a prefill leg's KV
    handle (``kv_transfer``)."""
    d = dump(response(id=gen.request_id, created=gen.created, model=model, choices=choices,
                      usage=usage(gen)))
    if gen.kv_result is not None:
        d["kv_transfer"] = gen.kv_result
        if gen.trace is not None:  # the decode replica's transfer span links to this one
            d["kv_transfer"] = {**gen.kv_result, "traceparent": gen.trace.traceparent()}
    return d


def include_usage(req: SamplingRequest) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
    return bool(req.stream_options and req.stream_options.include_usage)


async def stream_choices(gen: Generation, first: Update | None, n: int,
                         choice_chunk: ChoiceChunk,
                         usage_chunk: Callable[[UsageInfo], dict] | None) -> AsyncIterator[dict]:
    """The tail chat and completions share: each choice's delta (choice index ``prompt *
    n + i``, as in OpenAI's API) as the engine produces it, until it finishes; then an end for
    every choice cut short (the deadline: "length"; a forced shutdown: "abort"); then the
    usage chunk when asked."""
    done = [False] * (len(gen.prompts) * n)
    update = first
    while update is not None:
        i, out = update
        for comp in out.outputs:
            k = i * n + comp.index
            if done[k]:
                continue
            reason = gen.finish_reason(comp)
            chunk = choice_chunk(k, i, comp, reason)
            if chunk is not None:
                done[k] = reason is not None
                yield chunk
        update = await gen.next()
    for k, ended in enumerate(done):
        if not ended:
            chunk = choice_chunk(k, k // n, None, gen.finish_reason(None) or "length")
            if chunk is not None:
                yield chunk
    if usage_chunk is not None:
        yield usage_chunk(usage(gen))


async def _events(gen: Generation, first: Update | None, chunks: ChunkSource
                  ) -> AsyncIterator[str]:
    try:
        async for chunk in chunks(gen, first):
            yield sse(chunk)
    except ClientDisconnected:
        return
    except APIError as e:
        yield sse(error_body(e.message, type=e.type, param=e.param, code=e.code))
    except Exception:  # headers are sent: the stream still ends with an error and [DONE]
        logger.exception("stream %s failed", gen.request_id)
        yield sse(error_body("internal error", type="server_error", code="internal_error"))
    finally:
        gen.close()
    yield sse("[DONE]")


# (generation, its first update, the chunk source) -> the stream's SSE text
EventSource = Callable[[Generation, Update | None, ChunkSource], AsyncIterator[str]]


async def respond(gen: Generation, request: Request, stream: bool,
                  full: Callable[[Generation], dict], chunks: ChunkSource,
                  events: EventSource | None = None) -> Response:
    """``events``: how chunks become SSE text (default: ``data: {chunk}`` lines ending with
    ``data: [DONE]``, the completions' framing)."""
    request.scope[GENERATION_KEY] = gen
    handed_over = False
    try:
        first = await run_to_first(gen, request.receive)
        if stream:  # (the disconnect watcher stays on: GenerationStream)
            handed_over = True
            return GenerationStream((events or _events)(gen, first, chunks), gen)
        await gen.drain()
        gen.check_timeout_before_output()
        return SafeJSONResponse(full(gen))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not handed_over:
            gen.close()


class Handler:
    """One request to a generation endpoint, from its validated body to the HTTP answer. A
    subclass checks the request in ``__init__`` (400s come before admission) and sets what it
    asks for (``num_prompts``, the output ``constraint``); ``prepare`` tokenizes the prompts
    and makes the sampling parameters once admitted; ``full`` reads the finished
    ``Generation`` as one JSON response and ``chunks`` as a stream's."""

    id_prefix: str  # of the request id ("cmpl" -> "cmpl-...")
    events: EventSource | None = None  # a stream's framing (None: data: lines and [DONE])
    operation: str  # gen_ai.operation.name ("chat", "text_completion")
    num_prompts = 1
    constraint: Constraint | None = None

    def __init__(self, req: SamplingRequest, state: ServerState) -> None:
        self.req = req
        self.state = state
        # the answer names what ran: a LoRA adapter the request picked, else the served model
        self.model = (req.model if req.model in state.loras.adapters
                      else state.settings.served_model_name)

    async def prepare(self) -> tuple[list[Prompt], SamplingParams]:
        raise NotImplementedError

    def full(self, gen: Generation) -> dict:
        raise NotImplementedError

    def chunks(self, gen: Generation, first: Update | None) -> AsyncIterator[dict]:
        raise NotImplementedError

    async def answer(self, request: Request) -> Response:
        trace = None
        if self.state.tracing is not None:
            from kvserve.http.tracing import RequestTrace

            trace = RequestTrace(self.state.tracing, request.headers, self.operation,
                                 self.model, self.state.settings.role, self.req)
        try:
            gen = await new_generation(self.state, self.req, self.id_prefix, self.num_prompts,
                                       self.constraint, self.prepare)
        except BaseException as e:
            if trace is not None:
                trace.fail(e)
            raise
        gen.trace = trace
        return await respond(gen, request, self.req.stream, self.full, self.chunks,
                             self.events)
