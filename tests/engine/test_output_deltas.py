"""Deltas end to end (issue 30): a ``DELTA`` request's outputs carry only what is new, at a cost
per step that does not grow with the request's length, and they add up to exactly what the
cumulative path returns."""

from __future__ import annotations

from transformers import AutoTokenizer

from kvserve.engine.arg_utils import demo_model_path
from kvserve.engine.output_processor import OutputProcessor
from kvserve.request import Request
from kvserve.sampling_params import RequestOutputKind, SamplingParams

LENGTH = 4096


class CountingList(list):
    """A list that counts the elements copied out of it (slices, full walks, copies)."""

    copied = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        if isinstance(i, slice):
            CountingList.copied += len(got)
        return got

    def __iter__(self):
        CountingList.copied += len(self)
        return super().__iter__()

    def copy(self):
        CountingList.copied += len(self)
        return super().copy()


def _stream(kind: RequestOutputKind, length: int) -> tuple[list[int], list, Request]:
    """Drive the output path as ``Scheduler.update_from_output`` does, one token per step:
    elements copied per step, the outputs, and the request."""
    tok = AutoTokenizer.from_pretrained(demo_model_path())
    ids = tok.encode("def f(x):\n    return x  # café ünïcode\n")
    params = SamplingParams(max_tokens=length, ignore_eos=True, logprobs=1, stop=("@@@@",),
                            output_kind=kind)
    req = Request("r", "r", 0, ids, params, length)
    req.output_token_ids, req.logprobs = CountingList(), CountingList()
    proc = OutputProcessor(tok, eos_token_ids=())
    proc.add("r", None, ids, [req])
    per_step, outs = [], []
    for step in range(length):
        token = ids[step % len(ids)]
        before = CountingList.copied
        req.output_token_ids.append(token)
        status = proc.check_token(req, token, True, {token: -0.5}, -0.5, float(step))
        if status is not None:
            req.status = status
        outs.extend(proc.make_outputs(["r"]))
        per_step.append(CountingList.copied - before)
    assert req.is_finished and len(req.output_token_ids) == length
    return per_step, outs, req


def test_delta_stream_costs_o1_per_step():
    per_step, outs, req = _stream(RequestOutputKind.DELTA, LENGTH)
    # one new token and one new logprob per step: the same at token 4,000 as at token 10
    assert max(per_step) <= 2, max(per_step)
    assert per_step[10] == per_step[LENGTH - 10] == 2
    assert len(outs) == LENGTH and outs[-1].finished
    assert outs[0].prompt_logprobs is None  # not asked for
    # the deltas add up to the one cumulative output the offline API builds at the end
    _, (final,), _ = _stream(RequestOutputKind.FINAL_ONLY, LENGTH)
    assert final.finished
    assert [t for o in outs for t in o.outputs[0].token_ids] == final.outputs[0].token_ids \
        == list.copy(req.output_token_ids)
    assert [lp for o in outs for lp in o.outputs[0].logprobs] == final.outputs[0].logprobs
    assert "".join(o.outputs[0].text for o in outs) == final.outputs[0].text
    assert final.outputs[0].text.count("café") > 100


def test_cumulative_stream_copies_grow():
    """The instrument works: the cumulative kind copies everything every step."""
    per_step, outs, _ = _stream(RequestOutputKind.CUMULATIVE, 256)
    assert per_step[-1] >= 2 * 255 and per_step[-1] > per_step[10]
    assert len(outs) == 256


def test_engine_deltas_add_up_to_generate():
    """Through the engine (demo model, n=2, logprobs, prompt logprobs, a stop string): the
    deltas of a DELTA request concatenate to LLM.generate's outputs."""
    from kvserve import LLM

    llm = LLM(model="demo", seed=0)
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=40, logprobs=2,
                            prompt_logprobs=1, stop=("ing",))
    (want,) = llm.generate(["The history of the"], params)
    eng = llm.engine
    eng.add_request("d", "The history of the", params.clone(output_kind=RequestOutputKind.DELTA))
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[0].prompt_logprobs == want.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    for i, comp in enumerate(want.outputs):
        parts = [c for o in outs for c in o.outputs if c.index == i]
        assert [t for c in parts for t in c.token_ids] == comp.token_ids
        assert [lp for c in parts for lp in c.logprobs] == comp.logprobs
        assert "".join(c.text for c in parts) == comp.text
        assert parts[-1].finish_reason == comp.finish_reason
        assert parts[-1].stop_reason == comp.stop_reason
    eng.debug.check_no_leaks()
