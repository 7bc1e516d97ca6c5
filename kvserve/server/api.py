"""``build_app(engine_client, settings)``: the FastAPI application.

The app owns no threads and needs no lifespan: the caller starts the ``AsyncLLMEngine`` and
stops it after the server exits (see ``kvserve.serve_cli``). ``app.state.server`` is the
``ServerState`` (admission, draining flag, metrics).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.http.errors import (
    APIError,
    SafeJSONResponse,
    api_error_handler,
    http_error_handler,
    validation_error_handler,
)
from kvserve.http.middleware import AccessLog, APIKeyAuth, BodyLimit, ErrorCounter
from kvserve.http.openapi import (
    ERRORS,
    GENERATION_RESPONSES,
    RequestLimits,
    add_metrics_and_version,
    publish,
)
from kvserve.http.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    dump,
)
from kvserve.model.loader import load_tokenizer
from kvserve.server.chat import ChatHandler
from kvserve.server.completions import CompletionHandler
from kvserve.server.lora import add_lora_routes
from kvserve.server.prompts import check_model, check_request
from kvserve.server.responses import ResponsesHandler, not_found
from kvserve.server.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest
from kvserve.server.settings import ServerSettings
from kvserve.server.state import ServerState
from kvserve.version import __version__


def build_app(engine_client: AsyncLLMEngine, settings: ServerSettings,
              tokenizer=None) -> FastAPI:
    """``tokenizer``: the front end's own instance (default: loaded from the model folder;
    never share the engine's, which its thread uses). The caller stops the app's tokenizer
    threads with ``app.state.server.close()`` after serving."""
    if tokenizer is None:
        args = engine_client.engine_args
        tokenizer = load_tokenizer(args.tokenizer or engine_client.model_config.path)
    template = settings.chat_template_text()
    if template is not None:  # --chat-template replaces the model's (e.g. one with tools)
        tokenizer.chat_template = template
    state = ServerState(engine_client, settings, tokenizer)
    app = FastAPI(title="kvserve", version=__version__,
                  description="OpenAI-compatible LLM inference server")
    app.state.server = state
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    _routes(app, state)
    lim = state.limits
    publish(app, limits=lambda: RequestLimits(
        vocab_size=lim.vocab_size, max_model_len=lim.max_model_len,
        max_prompt_chars=lim.max_prompt_chars, max_n=settings.max_n,
        max_prompts=settings.max_prompts, tool_calls=settings.tool_call_parser is not None))
    # add_middleware prepends: the last added is the outermost.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=settings.api_key)
    app.add_middleware(ErrorCounter, counter=state.metrics.http_errors)
    if settings.access_log:
        app.add_middleware(AccessLog)
    return app


def _routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion; `stream: true` answers with server-sent events."""
        check_request(body, state.settings, state.loras.adapters)
        return await CompletionHandler(body, state).answer(request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion with the model's chat template; `stream: true` answers with SSE."""
        check_request(body, state.settings, state.loras.adapters)
        return await ChatHandler(body, state).answer(request)

    @app.post("/v1/responses", response_model=ResponseObject,
              responses=GENERATION_RESPONSES)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (text): `stream: true` answers with its SSE events;
        `store` keeps the answer for GET and `previous_response_id` (docs/server.md)."""
        check_model(body.model, state.settings, state.loras.adapters)
        return await ResponsesHandler(body, state).answer(request)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERRORS)
    async def get_response(response_id: str) -> Response:
        """A stored response (404 once deleted or evicted)."""
        entry = state.responses.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return SafeJSONResponse(entry.response)

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse,
                responses=ERRORS)
    async def delete_response(response_id: str) -> dict:
        if not state.responses.delete(response_id):
            raise not_found(response_id)
        return dump(DeletedResponse(id=response_id, deleted=True))

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> dict:
        name, max_len = state.settings.served_model_name, state.limits.max_model_len
        card = ModelCard(id=name, max_model_len=max_len)
        return dump(ModelList(data=[card, *state.loras.cards(name, max_len)]))

    add_lora_routes(app, state.loras, state.settings.served_model_name,
                    state.settings.lora_runtime_updates and state.loras.enabled)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread is alive."""
        if state.engine.is_alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine_dead"}, status_code=503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 while accepting requests; 503 while draining for shutdown."""
        if state.draining:
            return JSONResponse({"status": "draining", "in_flight": state.inflight},
                                status_code=503)
        if not state.engine.is_alive():
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        return JSONResponse({"status": "ready", "in_flight": state.inflight})

    add_metrics_and_version(app, state.metrics.render)

    @app.get("/kv_events")
    async def kv_events() -> dict:
        """Where this engine publishes its KV-cache events (null: it does not): routers
        subscribe there (docs/replicas.md)."""
        pub = getattr(state.engine, "kv_events", None)
        if pub is None:
            return {"endpoint": None, "replay_endpoint": None, "block_size": None}
        return {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                "block_size": pub.block_size, "format": pub.fmt}
