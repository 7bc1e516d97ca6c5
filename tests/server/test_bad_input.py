"""Bad input against the real server: HTTP 400 in OpenAI's error shape naming the parameter,
and after every bad request a normal one still succeeds."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL_NAME, assert_ok

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "w1 w2"}]
LONG_PROMPT = " ".join(f"w{i % 500}" for i in range(600))


def _c(**kw) -> dict:
    return {"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": 4, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 4, **kw}


CASES = [
    # (id, path, json body or raw bytes, expected param)
    ("context-overflow", CMPL, _c(max_tokens=510), "max_tokens"),
    ("context-overflow-chat", CHAT, _chat(max_completion_tokens=600), "max_completion_tokens"),
    ("prompt-too-long", CMPL, _c(prompt=LONG_PROMPT), "prompt"),
    ("n-over-limit", CMPL, _c(n=17), "n"),
    ("n-zero", CMPL, _c(n=0), "n"),
    ("top-logprobs-over-limit", CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), "top_logprobs"),
    ("logprobs-over-limit", CMPL, _c(logprobs=21), "logprobs"),
    ("nan-literal", CMPL, b'{"prompt": "w1", "temperature": NaN}', "temperature"),
    ("nan-string", CMPL, _c(top_p="NaN"), "top_p"),
    ("infinity", CHAT, b'{"messages": [{"role": "user", "content": "w1"}], '
                       b'"presence_penalty": Infinity}', "presence_penalty"),
    ("negative-max-tokens", CMPL, _c(max_tokens=-1), "max_tokens"),
    ("negative-temperature", CHAT, _chat(temperature=-0.5), "temperature"),
    ("zero-top-p", CMPL, _c(top_p=0), "top_p"),
    ("negative-seed", CMPL, _c(seed=-1), "seed"),
    ("penalty-out-of-range", CMPL, _c(frequency_penalty=2.5), "frequency_penalty"),
    ("repetition-penalty-zero", CMPL, _c(repetition_penalty=0), "repetition_penalty"),
    ("min-tokens-over-max", CMPL, _c(min_tokens=9), "min_tokens"),
    ("empty-messages", CHAT, _chat(messages=[]), "messages"),
    ("missing-messages", CHAT, {"model": MODEL_NAME}, "messages"),
    ("image-content", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages[0].content[0]"),
    ("missing-prompt", CMPL, {"model": MODEL_NAME}, "prompt"),
    ("empty-prompt", CMPL, _c(prompt=""), "prompt"),
    ("empty-prompt-list", CMPL, _c(prompt=[]), "prompt"),
    ("token-id-over-vocab", CMPL, _c(prompt=[1, 2, 512]), "prompt"),
    ("token-id-negative", CMPL, _c(prompt=[[1, 2], [-3]]), "prompt[1]"),
    ("token-id-huge", CMPL, _c(prompt=[10**30]), "prompt"),
    ("too-many-stops", CMPL, _c(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("empty-stop", CMPL, _c(stop=[""]), "stop"),
    ("wrong-type", CMPL, _c(max_tokens="many"), "max_tokens"),
    ("malformed-json", CMPL, b'{"prompt": "w1", ', None),
    ("json-not-object", CHAT, b'[1, 2, 3]', None),
    ("empty-body", CMPL, b"", None),
    # Lone surrogates (JSON "\ud800" escapes) used to be a bare 500 (issue 15, item 2).
    ("surrogate-model", CMPL, b'{"model": "\\ud800", "prompt": "w1"}', "model"),
    ("surrogate-prompt", CMPL, b'{"prompt": "a\\ud800b", "max_tokens": 3}', "prompt"),
    ("surrogate-prompt-batch", CMPL, b'{"prompt": ["w1", "x\\udfff"]}', "prompt[1]"),
    ("surrogate-stop", CMPL, b'{"prompt": "w1", "stop": ["\\udc00"]}', "stop[0]"),
    ("surrogate-cache-salt", CMPL, b'{"prompt": "w1", "cache_salt": "\\ud800"}', "cache_salt"),
    ("surrogate-user", CHAT, b'{"messages": [{"role": "user", "content": "w1"}], '
                             b'"user": "\\ud800"}', "user"),
    ("surrogate-content", CHAT, b'{"messages": [{"role": "user", "content": "w1\\ud800"}]}',
     "messages[0].content"),
    ("surrogate-content-part", CHAT, b'{"messages": [{"role": "user", "content": '
                                     b'[{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    # Strict types, as OpenAI's API defines them (issue 15, item 6).
    ("stream-string", CMPL, _c(stream="yes"), "stream"),
    ("stream-int", CHAT, _chat(stream=1), "stream"),
    ("echo-int", CMPL, _c(echo=0), "echo"),
    ("prompt-bools", CMPL, _c(prompt=[True, False]), "prompt"),
    ("prompt-bools-batch", CMPL, _c(prompt=[[1, True]]), "prompt"),
    ("max-tokens-numeric-string", CMPL, _c(max_tokens="5"), "max_tokens"),
    ("n-float", CMPL, _c(n=2.5), "n"),
    ("token-id-float", CMPL, _c(prompt=[1, 2.5]), "prompt"),
    ("logprobs-bool", CMPL, _c(logprobs=True), "logprobs"),
    ("chat-logprobs-string", CHAT, _chat(logprobs="true"), "logprobs"),
    ("include-usage-string", CMPL, _c(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage"),
    ("role-eos", CHAT, _chat(messages=[{"role": "eos", "content": "w1"}]), "messages[0].role"),
    ("role-missing", CHAT, _chat(messages=[{"content": "w1"}]), "messages[0].role"),
    ("text-part-without-text", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "text"}]}]), "messages[0].content[0]"),
    ("content-part-without-type", CHAT, _chat(messages=[{"role": "user", "content": [
        {"text": "w1"}]}]), "messages[0].content[0].type"),
    ("empty-prompt-in-batch", CMPL, _c(prompt=["w1", ""]), "prompt[1]"),
    ("too-many-sequences", CMPL, _c(prompt=["w1"] * 64, n=16), "n"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_is_400_naming_the_parameter(client, path, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err
    assert_ok(client)


MESSAGES = [
    # (body, words the message must contain)
    (_chat(messages=[{"role": "eos", "content": "w1"}]), ["role", "'user'", "'developer'"]),
    (_chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), ["text", "field"]),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x"}}]}]), ["'image_url'", "not support", "text parts"]),
    (_c(prompt="a\ud800b"), ["surrogate", "character 1"]),
    (_c(prompt=["w1"] * 64, n=16), ["1024 sequences", "64 prompt(s) x n=16", "at most 320"]),
]


@pytest.mark.parametrize("body,words", MESSAGES, ids=[str(i) for i in range(len(MESSAGES))])
def test_error_messages_say_what_is_wrong(client, body, words):
    r = client.post(CHAT if "messages" in body else CMPL, content=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"})  # json.dumps escapes \ud800
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, (word, message)


def test_no_bad_request_was_a_server_error(client):
    metrics = client.get("/metrics").text
    assert 'kvserve_http_errors_total{status="400"}' in metrics
    assert not any(line.startswith('kvserve_http_errors_total{status="5')
                   for line in metrics.splitlines())


def test_developer_role_is_accepted(client):
    r = client.post(CHAT, json=_chat(messages=[{"role": "developer", "content": "w3"},
                                               {"role": "user", "content": "w1 w2"}]))
    assert r.status_code == 200, r.text


def test_unexpected_exception_is_an_openai_500_and_counted(inprocess):
    srv = inprocess()

    @srv.app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("unexpected")

    async def main():
        async with srv.client() as c:
            r = await c.get("/boom")
            assert r.status_code == 500
            assert r.json() == {"error": {"message": "internal server error",
                                          "type": "server_error", "param": None,
                                          "code": "internal_error"}}
            metrics = (await c.get("/metrics")).text
            assert 'kvserve_http_errors_total{status="500"} 1.0' in metrics
            r = await c.post(CMPL, json=_c())
            assert r.status_code == 200, r.text

    srv.run(main())


def test_unknown_model_is_404(client):
    r = client.post(CMPL, json=_c(model="gpt-4"))
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"
    assert_ok(client)


def test_unknown_fields_are_ignored(client):
    r = client.post(CHAT, json=_chat(frobnicate=True, tools=[], logit_bias={"1": 5},
                                     response_format={"type": "text"}))
    assert r.status_code == 200, r.text
    assert_ok(client)


def test_integral_floats_are_integers(client):
    """JSON's 2.0 is the integer 2 (the schema's "integer" admits it): accepted as 2."""
    r = client.post(CMPL, json=_c(n=2.0, max_tokens=3.0, seed=7.0, prompt=[1.0, 2],
                                  ignore_eos=True))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["usage"]["prompt_tokens"] == 2
    assert_ok(client)


def test_kvserve_fields_accepted(client):
    r = client.post(CMPL, json=_c(top_k=5, min_p=0.05, repetition_penalty=1.2, min_tokens=2,
                                  ignore_eos=True, priority=3, cache_salt="tenant-a",
                                  presence_penalty=0.5, frequency_penalty=0.5, user="u1"))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert_ok(client)
