"""``POST /v1/completions``: prompt(s) -> engine -> OpenAI text-completion response.

A batch of prompts runs as one engine request per prompt; choice ``index`` is
``prompt_index * n + i`` as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from kvserve.outputs import CompletionOutput
from kvserve.server.generation import Generation
from kvserve.server.logprobs import TextOffsets, completion_logprobs
from kvserve.server.prompts import (
    check_lengths,
    check_model,
    check_n,
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
from kvserve.server.streaming import Update, respond


async def create_completion(req: CompletionRequest, request: Request,
                            state: ServerState) -> Response:
    check_model(req.model, state.settings)
    check_n(req.n, state.settings)
    items = completion_items(req, state.limits, state.settings)
    ticket = state.admit(len(items), req.n)
    try:
        prompts = await state.pool.run(tokenize_prompts, items, state.limits)
        check_lengths(prompts, req.max_tokens, state.limits, "prompt", "max_tokens")
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        params = sampling_params(req, max_tokens=req.max_tokens, max_tokens_param="max_tokens",
                                 logprobs=req.logprobs, prompt_logprobs=prompt_lp,
                                 limits=state.limits)
        gen = Generation(state, state.new_id("cmpl"), prompts, params, ticket,
                         priority=req.priority, cache_salt=req.cache_salt)
    except BaseException:
        ticket.release()
        raise
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
        out = gen.latest[i]
        if out is None or out.prompt_logprobs is None:
            return None
        return completion_logprobs(gen.prompts[i].token_ids, out.prompt_logprobs,
                                   self.state.text, offsets)

    def _logprobs(self, comp: CompletionOutput, start: int, offsets: TextOffsets,
                  echo: CompletionLogprobs | None) -> CompletionLogprobs | None:
        if self.req.logprobs is None or comp.logprobs is None:
            return None
        res = completion_logprobs(comp.token_ids[start:], comp.logprobs[start:],
                                  self.state.text, offsets)
        if echo is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(echo, name).extend(getattr(res, name))
            return echo
        return res

    def _usage(self, gen: Generation) -> UsageInfo:
        p, c = gen.num_prompt_tokens, gen.num_generated_tokens
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

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
                    lp = self._logprobs(comp, 0, offsets, echo_lp)
                choices.append(CompletionChoice(
                    index=i * n + j, text=prefix + (comp.text if comp else ""), logprobs=lp,
                    finish_reason=gen.finish_reason(comp),
                    stop_reason=comp.stop_reason if comp else None,
                ))
        return dump(CompletionResponse(id=gen.request_id, created=gen.created,
                                       model=self.model, choices=choices,
                                       usage=self._usage(gen)))

    async def chunks(self, gen: Generation, first: Update | None) -> AsyncIterator[dict]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> dict:
            d = dump(CompletionResponse(id=gen.request_id, created=gen.created,
                                        model=self.model, choices=choices, usage=usage))
            if not include_usage:
                d.pop("usage", None)
            return d

        n, total = self.req.n, len(gen.prompts) * self.req.n
        sent_text, sent_tokens = [0] * total, [0] * total
        offsets = [TextOffsets() for _ in range(total)]
        started, done = [False] * total, [False] * total
        update = first
        while update is not None:
            i, out = update
            for comp in out.outputs:
                k = i * n + comp.index
                if done[k]:
                    continue
                prefix, echo_lp = "", None
                text = comp.text[sent_text[k]:]
                if not started[k] and self.req.echo:
                    prefix = self._prompt_text(gen, i)
                offsets[k].extend(prefix + text)
                if prefix:
                    echo_lp = self._echo_logprobs(gen, i, offsets[k])
                new = len(comp.token_ids) - sent_tokens[k]
                reason = gen.finish_reason(comp)
                if not prefix and not text and reason is None and \
                        not (self.req.logprobs is not None and new):
                    continue
                lp = self._logprobs(comp, sent_tokens[k], offsets[k], echo_lp)
                started[k], done[k] = True, reason is not None
                sent_text[k], sent_tokens[k] = len(comp.text), len(comp.token_ids)
                yield chunk([CompletionChoice(index=k, text=prefix + text, logprobs=lp,
                                              finish_reason=reason,
                                              stop_reason=comp.stop_reason if reason else None)])
            update = await gen.next()
        for k in range(total):  # cut by the deadline or a forced shutdown before finishing
            if not done[k]:
                yield chunk([CompletionChoice(index=k, text="",
                                              finish_reason=gen.finish_reason(None) or "length")])
        if include_usage:
            yield chunk([], self._usage(gen))
