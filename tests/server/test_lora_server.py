"""LoRA adapters over HTTP with the official openai client, against a real ``kvserve serve``:
``--lora-modules`` at start, ``/v1/models`` listing adapters with their parent, a request
picking an adapter by ``model`` (greedy output equal to transformers + peft merged), runtime
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's bodies), bad adapters as
400s naming the field, and a start-up error for a bad ``--lora-modules``. The snippets in
docs/server.md#lora-adapters are these calls."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.lora_util import make_adapter, merged_hf
from tests.server.conftest import MODEL_NAME, ServerProcess

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

PROMPT = [1, 5, 9, 33, 40, 2, 7]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-server")
    return {"sql": make_adapter(tiny_llama, str(d / "sql"), r=8, seed=11),
            "chat": make_adapter(tiny_llama, str(d / "chat"), r=4, targets=["q_proj", "v_proj"],
                                 seed=12),
            "big": make_adapter(tiny_llama, str(d / "big"), r=32, seed=13)}


@pytest.fixture(scope="module")
def server(adapters, tiny_llama):
    srv = ServerProcess(tiny_llama, "--lora-modules", f"sql={adapters['sql']}",
                        "--max-loras", "2", "--max-lora-rank", "16", "--dtype", "fp32",
                        "--kv-cache-dtype", "fp32", "--lora-dtype", "float32")  # exact
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def _reference(base: str, adapter: str | None) -> list[int]:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        hf = merged_hf(hf, adapter)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _tokens(client, model: str) -> list[int]:
    """The greedy continuation's token ids (the tiny vocabulary: token "wN" is id N + 3)."""
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True,
                                                          "skip_special_tokens": False})
    assert r.model == model
    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return [specials[t] if t in specials else int(t.removeprefix("w")) + 3
            for t in r.choices[0].logprobs.tokens]


def test_models_and_requests_by_adapter(client, adapters, tiny_llama):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "sql"}
    assert models["sql"].parent == MODEL_NAME and models["sql"].root == adapters["sql"]
    assert _tokens(client, "sql") == _reference(tiny_llama, adapters["sql"])
    assert _tokens(client, MODEL_NAME) == _reference(tiny_llama, None)
    chat = client.chat.completions.create(model="sql", max_tokens=4,
                                          messages=[{"role": "user", "content": "w1 w2"}])
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    resp = client.responses.create(model="sql", input="w1 w2", max_output_tokens=4)
    assert resp.model == "sql" and resp.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w1", max_tokens=2)


def test_runtime_load_and_unload(client, adapters, tiny_llama):
    ok = client.post("/load_lora_adapter", cast_to=str,
                     body={"lora_name": "chat", "lora_path": adapters["chat"]})
    assert "chat" in ok
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "sql", "chat"}
    assert _tokens(client, "chat") == _reference(tiny_llama, adapters["chat"])
    client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "chat"})
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "sql"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt="w1", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", cast_to=str, body={"lora_name": "chat"})


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"lora_name": "x", "lora_path": "/nowhere"}, "lora_path", "not a directory"),
    ({"lora_name": "sql", "lora_path": "/nowhere"}, "lora_name", "already in use"),
    ({"lora_name": MODEL_NAME, "lora_path": "/nowhere"}, "lora_name", "already in use"),
    ({"lora_name": "big", "lora_path": "BIG"}, "lora_path", "over max_lora_rank 16"),
])
def test_bad_adapter_is_a_400(client, adapters, body, param, message):
    body = {k: adapters["big"] if v == "BIG" else v for k, v in body.items()}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/load_lora_adapter", cast_to=str, body=body)
    assert e.value.body["param"] == param and message in e.value.body["message"]


def test_bench_serve_lora_mix(server):
    """``kvserve bench serve --lora-mix``: requests spread over the adapters /v1/models lists
    (here the one), or over the names given; an adapter the server lacks is refused."""
    from kvserve.bench.serve_bench import run_serve_bench

    r = run_serve_bench(server.url, concurrency=4, requests=6, max_tokens=3, lora_mix="all")
    assert r["failed"] == 0 and r["models"] == {"sql": 6}
    with pytest.raises(ValueError, match="lora_mix"):
        run_serve_bench(server.url, concurrency=2, requests=2, max_tokens=2, lora_mix="sql,zz")


def test_bad_lora_module_is_a_startup_error(tiny_llama, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", tiny_llama,
                        "--lora-modules", f"bad={tmp_path}", "--kv-cache-memory", "16MiB"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "lora_modules bad" in r.stderr and "adapter_config.json" in r.stderr
