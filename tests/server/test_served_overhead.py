"""What `kvserve serve` sets up so the event loop costs the engine little (docs/server.md,
"Served vs offline"): OpenMP workers that stop spinning soon after a forward, a short GIL
switch interval, and the engine step's hook where the loop gets the previous step's outputs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.serve_cli import SERVE_GOMP_SPINCOUNT, quiet_openmp_spin
from kvserve.server.settings import LaunchSettings


def test_openmp_spin_is_shortened_unless_the_environment_says_otherwise():
    env: dict[str, str] = {}
    assert quiet_openmp_spin(env) and env == {"GOMP_SPINCOUNT": SERVE_GOMP_SPINCOUNT}
    for given in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(given)
        assert not quiet_openmp_spin(env) and env == given
    # this process has torch loaded: libgomp has read its settings, nothing is changed
    assert "torch" in sys.modules and not quiet_openmp_spin()


def test_serve_sets_the_spin_before_torch_loads():
    """`kvserve serve`'s entry point shortens the spin before anything loads torch."""
    code = ("import os, sys\n"
            "from kvserve import serve_cli\n"
            "serve_cli.serve = lambda ns, args: print(os.environ.get('GOMP_SPINCOUNT'))\n"
            "import argparse\n"
            "p = argparse.ArgumentParser(); serve_cli.register(p.add_subparsers())\n"
            "ns = p.parse_args(['serve', 'demo']); ns.func(ns)\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == SERVE_GOMP_SPINCOUNT


def test_switch_interval_is_checked():
    assert LaunchSettings().switch_interval_ms == 0.2
    for bad in (0.0, -1.0, 5000.0):
        with pytest.raises(ValueError, match="switch_interval_ms"):
            LaunchSettings(switch_interval_ms=bad)


def test_before_forward_runs_once_per_scheduled_step_before_its_forward(tiny_llama):
    engine = LLMEngine(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", progress=False))
    seen: list[int] = []
    engine.add_request("a", "w1 w2", SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step(before_forward=lambda: seen.append(engine.counters["steps"]))
    assert seen == [0, 1, 2]  # each call came before its step was counted (the forward)
    engine.step(before_forward=lambda: seen.append(-1))  # nothing scheduled: not called
    assert seen == [0, 1, 2]


def test_serve_runs_on_uvloop_and_httptools():
    """uvicorn's "auto" choices, as `kvserve serve` configures it: uvloop (its
    call_soon_threadsafe wakes the loop without the engine thread dropping the GIL) and
    httptools (less of the loop's CPU per chunk)."""
    import uvloop
    from fastapi import FastAPI

    from kvserve.http.launch import DrainingServer

    app = FastAPI()
    app.state.server = object()
    config = DrainingServer.create(app, "127.0.0.1", 0, 1.0).config
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    loop = config.get_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


@pytest.mark.parametrize("with_usage", [False, True])
def test_chunk_envelope_is_the_whole_chunk_dumped(with_usage):
    """A stream's chunk from its envelope: byte for byte the response model dumped whole (keys
    in the same order), for text and chat chunks, with and without the usage field."""
    import json
    from types import SimpleNamespace

    from kvserve.http.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        CompletionChoice,
        CompletionResponse,
        DeltaMessage,
        PromptTokensDetails,
        UsageInfo,
        dump,
    )
    from kvserve.server.streaming import ChunkEnvelope

    gen = SimpleNamespace(request_id="cmpl-x", created=1765000000)
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=1))
    cases = ((CompletionResponse, CompletionChoice(index=1, text=" a", finish_reason="length",
                                                   stop_reason=7)),
             (ChatCompletionChunk, ChatChunkChoice(index=0, delta=DeltaMessage(content="b"))))
    for response, choice in cases:
        envelope = ChunkEnvelope(response, gen, "m", with_usage)
        for choices, u in (([choice], None), ([], usage if with_usage else None)):
            whole = dump(response(id=gen.request_id, created=gen.created, model="m",
                                  choices=choices, usage=u))
            if not with_usage:
                whole.pop("usage")
            got = envelope([dump(c) for c in choices], u)
            assert json.dumps(got) == json.dumps(whole)


def test_plain_completion_choice_is_the_model_dumped():
    """A token's completion choice built as a dict: the same keys, order and values as the
    pydantic choice dumped, for every finish and stop reason a stream sends."""
    import json

    from kvserve.http.protocol import CompletionChoice, dump
    from kvserve.server.completions import plain_choice

    for index, text, reason, stop in ((0, " a", None, None), (3, "", "length", None),
                                      (1, "é\n\"x\"", "stop", 7), (2, "b", "stop", "END"),
                                      (5, "c", "abort", None), (0, "", "grammar_dead_end", None)):
        model = CompletionChoice(index=index, text=text, finish_reason=reason, stop_reason=stop)
        assert json.dumps(plain_choice(index, text, reason, stop)) == json.dumps(dump(model))


def test_plain_chat_choice_is_the_model_dumped_without_unset_delta_fields():
    """A token's chat choice built as a dict: what the stream sent from the pydantic choice
    (its delta without the fields left unset), key for key and in order."""
    import json

    from kvserve.http.protocol import ChatChunkChoice, DeltaMessage, dump
    from kvserve.server.chat import plain_chat_choice

    for index, content, reasoning, reason, stop in (
            (0, "a", None, None, None), (1, "", "think", None, None), (2, "", None, "length", None),
            (0, "é\n\"x\"", "r", "stop", 7), (3, "b", None, "stop", "END")):
        model = dump(ChatChunkChoice(index=index, delta=DeltaMessage(
            content=content, reasoning_content=reasoning), finish_reason=reason,
            stop_reason=stop))
        model["delta"] = {k: v for k, v in model["delta"].items() if v is not None}
        got = plain_chat_choice(index, content, reasoning, reason, stop)
        assert json.dumps(got) == json.dumps(model)
