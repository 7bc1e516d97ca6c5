"""``POST /v1/completions``: prompt(s) -> engine -> OpenAI text-completion response.

A batch of prompts runs as one engine request per prompt; choice ``index`` is
``prompt_index * n + i`` as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvserve.http.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    dump,
)
from kvserve.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.generation import Generation
from kvserve.server.logprobs import TextOffsets, completion_logprobs
from kvserve.server.prompts import (
    Prompt,
    check_lengths,
    completion_items,
    sampling_params,
    tokenize_prompts,
)
from kvserve.server.state import ServerState
from kvserve.server.streaming import (
    ChunkEnvelope,
    Handler,
    Update,
    full_response,
    include_usage,
    stream_choices,
)
from kvserve.server.structured import output_constraint


def plain_choice(index: int, text: str, finish_reason: str | None,
                 stop_reason: int | str | None) -> dict:
    """``dump(CompletionChoice(...))`` of a choice without logprobs, built as the dict itself
    (the same keys in the same order; a test compares them): a stream's chunk per token
    without a pydantic model to build and dump on the event loop."""
    return {"index": index, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "text": text}


class CompletionHandler(Handler):
    """One text completion of a prompt or a batch of them; with ``echo`` each choice's text
    (and logprobs) starts with its prompt's."""

    req: CompletionRequest
    id_prefix = "cmpl"
    operation = "text_completion"

    def __init__(self, req: CompletionRequest, state: ServerState) -> None:
        super().__init__(req, state)
        self.items = completion_items(req, state.limits, state.settings)
        self.num_prompts = len(self.items)
        self.constraint = output_constraint(req)

    async def prepare(self) -> tuple[list[Prompt], SamplingParams]:
        req, state = self.req, self.state
        prompts = await state.pool.run(tokenize_prompts, self.items, state.limits)
        check_lengths(prompts, req.max_tokens, state.limits, "prompt", "max_tokens")
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        return prompts, sampling_params(
            req, max_tokens=req.max_tokens, max_tokens_param="max_tokens",
            logprobs=req.logprobs, prompt_logprobs=prompt_lp, limits=state.limits)

    def _prompt_text(self, gen: Generation, i: int) -> str:
        p = gen.prompts[i]
        return p.text if p.text is not None else self.state.text.decode(p.token_ids)

    def _echo_logprobs(self, gen: Generation, i: int,
                       offsets: TextOffsets) -> CompletionLogprobs | None:
        plp = gen.prompt_logprobs[i]
        if plp is None:
            return None
        return completion_logprobs(gen.prompts[i].token_ids, plp, self.state.text, offsets)

    def _logprobs(self, comp: CompletionOutput, offsets: TextOffsets,
                  echo: CompletionLogprobs | None) -> CompletionLogprobs | None:
        if self.req.logprobs is None or comp.logprobs is None:
            return None
        res = completion_logprobs(comp.token_ids, comp.logprobs, self.state.text, offsets)
        if echo is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(echo, name).extend(getattr(res, name))
            return echo
        return res

    def full(self, gen: Generation) -> dict:
        choices = []
        n = self.req.n
        for i in range(len(gen.prompts)):
            for j in range(n):
                comp = gen.completion(i, j)
                prefix = self._prompt_text(gen, i) if self.req.echo else ""
                offsets = TextOffsets(prefix + (comp.text if comp else ""))
                echo_lp = self._echo_logprobs(gen, i, offsets) if self.req.echo else None
                lp = None
                if comp is not None:
                    lp = self._logprobs(comp, offsets, echo_lp)
                choices.append(CompletionChoice(
                    index=i * n + j, text=prefix + (comp.text if comp else ""), logprobs=lp,
                    finish_reason=gen.finish_reason(comp),
                    stop_reason=comp.stop_reason if comp else None,
                ))
        return full_response(gen, CompletionResponse, self.model, choices)

    async def chunks(self, gen: Generation, first: Update | None) -> AsyncIterator[dict]:
        with_usage = include_usage(self.req)

        envelope = ChunkEnvelope(CompletionResponse, gen, self.model, with_usage)

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> dict:
            return envelope([dump(c) for c in choices], usage)

        total = len(gen.prompts) * self.req.n
        offsets = [TextOffsets() for _ in range(total)]
        started = [False] * total

        def choice_chunk(k: int, i: int, comp: CompletionOutput | None,
                         reason: str | None) -> dict | None:
            if comp is None:  # cut short
                return chunk([CompletionChoice(index=k, text="", finish_reason=reason)])
            prefix = self._prompt_text(gen, i) if not started[k] and self.req.echo else ""
            offsets[k].extend(prefix + comp.text)
            echo_lp = self._echo_logprobs(gen, i, offsets[k]) if prefix else None
            if not prefix and not comp.text and reason is None and \
                    not (self.req.logprobs is not None and comp.token_ids):
                return None
            started[k] = True
            lp = self._logprobs(comp, offsets[k], echo_lp)
            stop = comp.stop_reason if reason else None
            if lp is None:  # a token's chunk, the common case: no model built per token
                return envelope([plain_choice(k, prefix + comp.text, reason, stop)])
            return chunk([CompletionChoice(index=k, text=prefix + comp.text, logprobs=lp,
                                           finish_reason=reason, stop_reason=stop)])

        async for d in stream_choices(gen, first, self.req.n, choice_chunk,
                                      (lambda u: chunk([], u)) if with_usage else None):
            yield d
