"""``POST /v1/completions``: prompt(s) -> engine -> OpenAI text-completion response.

A batch of prompts runs as one engine request per prompt; choice ``index`` is
``prompt_index * n + i`` as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from kvserve.outputs import CompletionOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.generation import Generation, new_generation
from kvserve.server.logprobs import TextOffsets, completion_logprobs
from kvserve.server.prompts import (
    Prompt,
    check_lengths,
    completion_items,
    sampling_params,
    tokenize_prompts,
)
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    dump,
)
from kvserve.server.state import ServerState
from kvserve.server.streaming import Update, full_response, include_usage, respond, stream_choices
from kvserve.server.structured import output_constraint


async def create_completion(req: CompletionRequest, request: Request,
                            state: ServerState) -> Response:
    items = completion_items(req, state.limits, state.settings)
    constraint = output_constraint(req)

    async def prepare() -> tuple[list[Prompt], SamplingParams]:
        prompts = await state.pool.run(tokenize_prompts, items, state.limits)
        check_lengths(prompts, req.max_tokens, state.limits, "prompt", "max_tokens")
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        return prompts, sampling_params(
            req, max_tokens=req.max_tokens, max_tokens_param="max_tokens",
            logprobs=req.logprobs, prompt_logprobs=prompt_lp, limits=state.limits)

    gen = await new_generation(state, req, "cmpl", len(items), constraint, prepare)
    view = _CompletionView(req, state)
    return await respond(gen, request, req.stream, view.full, view.chunks)


class _CompletionView:
    def __init__(self, req: CompletionRequest, state: ServerState) -> None:
        self.req = req
        self.state = state
        self.model = state.settings.served_model_name

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

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> dict:
            d = dump(CompletionResponse(id=gen.request_id, created=gen.created,
                                        model=self.model, choices=choices, usage=usage))
            if not with_usage:
                d.pop("usage", None)
            return d

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
            return chunk([CompletionChoice(
                index=k, text=prefix + comp.text,
                logprobs=self._logprobs(comp, offsets[k], echo_lp), finish_reason=reason,
                stop_reason=comp.stop_reason if reason else None)])

        async for d in stream_choices(gen, first, self.req.n, choice_chunk,
                                      (lambda u: chunk([], u)) if with_usage else None):
            yield d
