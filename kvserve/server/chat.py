"""``POST /v1/chat/completions``: messages (+ tools) -> chat template -> engine (+ grammar) ->
OpenAI response, with the tool calls the parser reads out of the answer."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from kvserve.http.errors import bad_request
from kvserve.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    UsageInfo,
    dump,
)
from kvserve.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.generation import Generation
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.prompts import (
    Prompt,
    chat_conversation,
    check_budget,
    check_lengths,
    check_template_kwargs,
    sampling_params,
    tokenize_chat,
)
from kvserve.server.reasoning import ReasoningStream
from kvserve.server.state import ServerState
from kvserve.server.streaming import (
    ChunkEnvelope,
    Handler,
    Update,
    full_response,
    include_usage,
    stream_choices,
)
from kvserve.server.structured import output_constraint, tool_plan
from kvserve.server.tool_parsers import StreamingToolCalls, new_call_id


def plain_chat_choice(index: int, content: str, reasoning_content: str | None,
                      finish_reason: str | None, stop_reason: int | str | None) -> dict:
    """A streamed chat choice without logprobs or tool calls as the dict its model dumps to
    with the unset delta fields left out (what ``chunks`` sends; a test compares them),
    without a pydantic model to build and dump per token on the event loop."""
    delta: dict = {"content": content}
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    return {"index": index, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "delta": delta}


class ChatHandler(Handler):
    """One chat completion: checked and planned before admission (the conversation; the tool
    plan: the template's tools, the call parser, the calls' grammar; the output format), read
    back with the tool calls its parser finds in the answer."""

    req: ChatCompletionRequest
    id_prefix = "chatcmpl"
    operation = "chat"

    def __init__(self, req: ChatCompletionRequest, state: ServerState) -> None:
        super().__init__(req, state)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.conversation = chat_conversation(req, state.tokenizer, state.limits)
        self.plan = tool_plan(req, state.settings)
        constraint = output_constraint(req)
        if constraint is not None and self.plan.forced:
            raise bad_request("tool_choice 'required' or a named function constrains the "
                              "answer to tool calls: it cannot be combined with "
                              "response_format or structured_outputs", "tool_choice")
        # auto with strict tools: response_format / structured_outputs decide the answer
        # instead (a JSON answer has no room for calls), as without strict tools
        self.constraint = constraint or self.plan.constraint
        self.parser = self.plan.parser
        self.top = req.top_logprobs or 0
        self.template_kwargs = check_template_kwargs(req.chat_template_kwargs)
        self.reasoning = state.reasoning
        self.answer_state = "content"  # where the answer starts (set once the prompt is known)

    async def prepare(self) -> tuple[list[Prompt], SamplingParams]:
        req, state = self.req, self.state
        prompt = await state.pool.run(tokenize_chat, self.conversation,
                                      req.add_generation_prompt, state.limits,
                                      self.plan.template_tools, self.template_kwargs)
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
            check_budget(req.max_tokens, state.limits, "max_tokens")  # overridden, yet bounded
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        check_lengths([prompt], max_tokens, state.limits, "messages", max_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(
            req, max_tokens=max_tokens, max_tokens_param=max_param, logprobs=logprobs,
            prompt_logprobs=None, limits=state.limits)
        if self.reasoning is not None:
            self.answer_state = self.reasoning.initial_state(prompt.token_ids)
            gate = self.reasoning.grammar_state(self.answer_state)
            if self.constraint is not None and gate is not None:  # the grammar after reasoning
                params = params.clone(structured_outputs=dataclasses.replace(
                    self.constraint.params, reasoning_state=gate,
                    reasoning_start_token_id=self.reasoning.start_token_id,
                    reasoning_end_token_id=self.reasoning.end_token_id))
        return [prompt], params

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content, content) of a whole answer."""
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, self.answer_state)

    def _logprobs(self, token_ids, logprobs) -> ChoiceLogprobs | None:
        if not self.req.logprobs or logprobs is None:
            return None
        return ChoiceLogprobs(content=chat_logprobs(token_ids, logprobs, self.top,
                                                    self.state.text))

    def full(self, gen: Generation) -> dict:
        choices = []
        for i in range(self.req.n):
            comp = gen.completion(0, i)
            reason = gen.finish_reason(comp)
            reasoning, text = self.split(comp.text) if comp else (None, "")
            message = AssistantMessage(content=text, reasoning_content=reasoning)
            if self.parser is not None and comp is not None:
                content, calls = self.parser.extract(text)
                if calls:
                    message = AssistantMessage(content=content, reasoning_content=reasoning,
                                               tool_calls=[
                        ToolCallOut(id=new_call_id(), function=FunctionCallOut(
                            name=c.name, arguments=c.arguments)) for c in calls])
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append(ChatChoice(
                index=i, message=message,
                logprobs=self._logprobs(comp.token_ids, comp.logprobs) if comp else None,
                finish_reason=reason, stop_reason=comp.stop_reason if comp else None,
            ))
        return full_response(gen, ChatCompletionResponse, self.model, choices)

    async def chunks(self, gen: Generation, first: Update | None) -> AsyncIterator[dict]:
        with_usage = include_usage(self.req)

        envelope = ChunkEnvelope(ChatCompletionChunk, gen, self.model, with_usage)

        def chunk(choice: ChatChunkChoice | None, usage: UsageInfo | None = None) -> dict:
            choices = [dump(choice)] if choice else []
            for ch in choices:  # OpenAI omits unset delta fields
                ch["delta"] = {k: v for k, v in ch["delta"].items() if v is not None}
            return envelope(choices, usage)

        calls = [StreamingToolCalls(self.parser) if self.parser else None
                 for _ in range(self.req.n)]
        thinking = [ReasoningStream(self.answer_state) if self.reasoning else None
                    for _ in range(self.req.n)]

        def choice_chunk(k: int, _: int, comp: CompletionOutput | None,
                         reason: str | None) -> dict | None:
            stream, think = calls[k], thinking[k]
            if comp is None:  # cut short: what a tool parser held goes out as content
                r, text = think.finish() if think is not None else ("", "")
                if stream is not None:
                    text = stream.feed(text) + stream.finish()[0]
                return chunk(ChatChunkChoice(index=k, delta=DeltaMessage(
                    content=text, reasoning_content=r or None), finish_reason=reason))
            r, text = think.feed(comp.text) if think is not None else ("", comp.text)
            if think is not None and reason is not None:
                r2, t2 = think.finish()
                r, text = r + r2, text + t2
            content, tool_calls = text, None
            if stream is not None:  # content before a call goes out; a call is held
                content = stream.feed(text)
                if reason is not None:
                    rest, found = stream.finish()
                    content += rest
                    if found:
                        tool_calls = [DeltaToolCall(
                            index=j, id=new_call_id(), type="function",
                            function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                            for j, c in enumerate(found)]
                        reason = "tool_calls" if reason == "stop" else reason
            if not content and not tool_calls and reason is None and not r and \
                    not (self.req.logprobs and comp.token_ids):
                return None
            lp = self._logprobs(comp.token_ids, comp.logprobs)
            stop = comp.stop_reason if reason else None
            if lp is None and tool_calls is None:  # a token's chunk: no model per token
                return envelope([plain_chat_choice(k, content, r or None, reason, stop)])
            return chunk(ChatChunkChoice(
                index=k, delta=DeltaMessage(content=content, reasoning_content=r or None,
                                            tool_calls=tool_calls),
                finish_reason=reason, logprobs=lp, stop_reason=stop))

        for i in range(self.req.n):
            yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                    content="")))
        async for d in stream_choices(gen, first, self.req.n, choice_chunk,
                                      (lambda u: chunk(None, u)) if with_usage else None):
            yield d
