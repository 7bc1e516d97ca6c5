"""Offline API mirroring vLLM: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine, PromptType
from kvserve.outputs import RequestOutput
from kvserve.request import LoRARequest
from kvserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        # one cumulative output per request, built when it finishes (no per-step copies)
        final = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params if isinstance(p, SamplingParams)}
        params = [final.get(id(p), p) for p in params]
        loras = ([lora_request] * len(prompts)
                 if lora_request is None or isinstance(lora_request, LoRARequest)
                 else list(lora_request))
        if len(loras) != len(prompts):
            raise ValueError("lora_request must be one LoRARequest or one per prompt")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, p, sp, priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt)}
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True
                            ) -> list[int]:
        if not conversation:
            raise ValueError("messages must not be empty")
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat_template")
        ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                if pending and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"requests vanished: {sorted(pending)}")
        return [done[i] for i in ids]
