"""``StepRunner``: one engine step on the driver, a ``SchedulerOutput`` in, a ``StepOutput`` out
(each rank's forward itself is ``model_runner.py``).

It turns the schedule into the step's ``StepInput`` (ids, positions, cache rows, block tables,
which hidden rows need logits), runs the forward on every rank through the executor, samples
rank 0's logits and turns prompt-logprobs chunks into logprobs. It never changes a request:
the scheduler applies the output (``Scheduler.update_from_output``).

Speculative decoding: a request with draft tokens d_1..d_k contributes k + 1 rows, each an
ordinary decode row (query length 1, its own position and seq_len, the request's block table),
so every row is computed exactly as a normal decode step computes it (the same kernels, the same
decode graphs). Row j is sampled as a normal step would sample position p + j after d_1..d_j
(penalties, seeded draws by output position, the grammar's mask after d_1..d_j); d_{j+1} is
accepted iff it is the token drawn. The emitted tokens therefore follow the target distribution
exactly (for a deterministic draft this is rejection sampling: d is accepted with probability
p(d), and a rejection draws from p restricted to tokens other than d), and a seeded or greedy
request gets the very tokens and logprobs it gets without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.engine.executor import Executor
from kvserve.engine.lora_manager import LoRAManager
from kvserve.engine.sampler import Sampler, SampleRow
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.engine.step_input import StepInput
from kvserve.engine.step_output import StepOutput


@dataclass(frozen=True, slots=True)
class _Plan:
    """The driver's side of a step: which request each logits group belongs to."""

    sample: list[ScheduledRequest]  # group 0's rows, in order (1 + len(draft) rows each)
    prompt_logprobs: list[tuple[str, int]]  # groups 1..: (request id, first target)


class StepRunner:
    def __init__(self, executor: Executor, block_size: int, components: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], lora: LoRAManager | None = None) -> None:
        self.executor = executor
        self.lora = lora  # LoRA adapters and their slots (None: LoRA off)
        self.block_size = block_size
        self.components = components
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(vocab_size)

    @property
    def graphs(self):
        """Rank 0's decode graphs (None: every step eager)."""
        return self.executor.driver.model_runner.graphs

    @property
    def backend(self):
        """Rank 0's attention backend."""
        return self.executor.driver.model_runner.backend

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> StepOutput:
        step, plan = self.prepare(sched.scheduled)
        logits = self.executor.execute(step)
        req_ids = [s.req.request_id for s in plan.sample]
        tokens: list[list[int]] = []
        lps: list[list] = []
        lp: list[list[float]] = []
        if plan.sample:
            rows = []
            for s in plan.sample:
                r = s.req
                if not s.draft:
                    rows.append(SampleRow(r.sampling_params, r.prompt_token_ids,
                                          r.output_token_ids, self.eos_token_ids, r.grammar))
                    continue
                masks = (r.grammar.masks_along(s.draft, self.sampler.vocab_size)
                         if r.grammar is not None else None)
                for j in range(len(s.draft) + 1):
                    rows.append(SampleRow(r.sampling_params, r.prompt_token_ids,
                                          r.output_token_ids + list(s.draft[:j]),
                                          self.eos_token_ids,
                                          masks[j] if masks is not None else None))
            assert logits[0] is not None
            sampled = self.sampler(logits[0].float().cpu(), rows)  # sampled on CPU
            i = 0
            for s in plan.sample:
                toks, l1, l2 = [], [], []
                for j in range(len(s.draft) + 1):  # accept drafts while they were drawn
                    t = sampled.token_ids[i + j]
                    toks.append(t)
                    l1.append(sampled.logprobs[i + j])
                    l2.append(sampled.sampled_logprob[i + j])
                    if j == len(s.draft) or t != s.draft[j]:
                        break
                i += len(s.draft) + 1
                tokens.append(toks)
                lps.append(l1)
                lp.append(l2)
        plp = [(rid, start, torch.log_softmax(lg.float(), dim=-1).cpu())
               for (rid, start), lg in zip(plan.prompt_logprobs, logits[1:], strict=True)]
        return StepOutput(req_ids, tokens, lps, lp, plp)

    @torch.inference_mode()
    def prompt_logits(self, s: ScheduledRequest) -> torch.Tensor:
        """Teacher-forced logits [P, V] fp32 of every position of one scheduled prompt."""
        step, _ = self.prepare([s])
        # group 0 (rows to sample) empty; group 1 every position, like a prompt-logprobs run
        step = StepInput(step.input_ids, step.positions, step.write_rows, step.query_lens,
                         step.seq_lens, step.block_tables, ((), tuple(range(s.num_new_tokens))),
                         step.lora_slots)
        logits = self.executor.execute(step)[1]
        assert logits is not None
        return logits.float().cpu()

    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[StepInput, _Plan]:
        """The step's input for every rank, and the driver's plan to read the logits back."""
        bs, c = self.block_size, self.components
        tables: list[tuple[int, ...]] = []
        if all(s.num_new_tokens == 1 or s.draft for s in scheduled):
            # decode rows only (a verified draft: 1 + k rows): plain lists, no numpy
            ids_l, pos_l, rows_l = [], [], []
            for s in scheduled:
                p = s.num_computed_tokens
                ids_l.append(s.req.token_range(p, p + 1)[0])
                ids_l.extend(s.draft)
                for q in range(p, p + 1 + len(s.draft)):
                    pos_l.append(q)
                    rows_l.append(s.block_ids[q // bs] * (c * bs) + q % bs)
                    tables.append(s.block_ids)
            i64 = torch.int64
            ids, pos = torch.tensor(ids_l, dtype=i64), torch.tensor(pos_l, dtype=i64)
            rows = torch.tensor(rows_l, dtype=i64)
            qlens, slens = [1] * len(ids_l), [p + 1 for p in pos_l]
        else:
            ids_a, pos_a, rows_a, qlens, slens = [], [], [], [], []
            for s in scheduled:
                start, n = s.num_computed_tokens, s.num_new_tokens
                p = np.arange(start, start + n, dtype=np.int64)
                blk = np.asarray(s.block_ids, dtype=np.int64)[p // bs]
                if s.draft:
                    ids_a.append(np.asarray([s.req.token_range(start, start + 1)[0],
                                             *s.draft], dtype=np.int64))
                    qlens.extend([1] * n)  # n decode rows
                    slens.extend(range(start + 1, start + n + 1))
                    tables.extend([s.block_ids] * n)
                else:
                    ids_a.append(np.asarray(s.req.token_range(start, start + n),
                                            dtype=np.int64))
                    qlens.append(n)
                    slens.append(start + n)
                    tables.append(s.block_ids)
                pos_a.append(p)
                rows_a.append(blk * (c * bs) + p % bs)
            ids = torch.from_numpy(np.concatenate(ids_a))
            pos = torch.from_numpy(np.concatenate(pos_a))
            rows = torch.from_numpy(np.concatenate(rows_a))
        plan = _Plan([], [])
        sample_rows: list[int] = []
        groups: list[tuple[int, ...]] = []
        loc = 0
        for s in scheduled:
            req, start, n = s.req, s.num_computed_tokens, s.num_new_tokens
            if s.draft:
                sample_rows.extend(range(loc, loc + n))
                plan.sample.append(s)
            elif start + n == req.num_tokens:
                sample_rows.append(loc + n - 1)
                plan.sample.append(s)
            if req.sampling_params.prompt_logprobs is not None and \
                    start + 1 < req.num_prompt_tokens:
                # hidden at position p predicts token p+1; record targets start+1 .. P-1.
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > start and start + 1 >= len(req.prompt_logprobs or ()):
                    groups.append(tuple(range(loc, loc + last - start)))
                    plan.prompt_logprobs.append((req.request_id, start + 1))
            loc += n
        lora_slots: tuple[int, ...] = ()
        if self.lora is not None and any(s.req.lora is not None for s in scheduled):
            # one slot per sequence of the step (a verified draft: one per row)
            per_req = self.lora.slots_for([s.req.lora for s in scheduled])
            lora_slots = tuple(x for s, x in zip(scheduled, per_req, strict=True)
                               for _ in range(1 + len(s.draft) if s.draft else 1))
        step = StepInput(ids, pos, rows, tuple(qlens), tuple(slens), tuple(tables),
                         (tuple(sample_rows), *groups), lora_slots)
        return step, plan
