"""LoRA adapters over HTTP (vLLM's API): ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` (bodies ``{"lora_name", "lora_path"}`` / ``{"lora_name"}``), the
adapters in ``GET /v1/models`` (``parent``: the served model), and a request's ``model``
naming an adapter runs it on that adapter. The engine checks every adapter (bad folder, shapes
against the base, rank over ``--max-lora-rank``, missing files): a 400 naming ``lora_path``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.http.errors import APIError, bad_request
from kvserve.http.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from kvserve.request import LoRARequest


class ServedAdapters:
    """The adapters the server answers for, by name (id, path): the engine's at start, then
    the loads and unloads it accepted. Event loop only."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.enabled = engine.engine_args.enable_lora
        paths = engine.engine_args.lora_module_paths()
        self.adapters: dict[str, tuple[int, str]] = {
            name: (lora_id, paths.get(name, "")) for name, lora_id in engine.list_loras()}

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The LoRARequest a request's ``model`` names (None: the base model)."""
        if model is None or model not in self.adapters:
            return None
        lora_id, path = self.adapters[model]
        return LoRARequest(model, lora_id, path)

    def cards(self, parent: str, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=path, parent=parent, max_model_len=max_model_len)
                for name, (_, path) in self.adapters.items()]

    async def load(self, body: LoadLoRAAdapterRequest, base_name: str) -> int:
        if not self.enabled:
            raise bad_request("LoRA is off on this server (start it with --enable-lora or "
                              "--lora-modules)", "lora_name")
        if body.lora_name == base_name or body.lora_name in self.adapters:
            raise bad_request(f"the adapter name {body.lora_name!r} is already in use",
                              "lora_name")
        name, path = body.lora_name, body.lora_path
        try:
            lora_id = await self.engine.call(lambda e: e.add_lora(name, path))
        except ValueError as e:
            param = "lora_name" if str(e).startswith("lora_name") else "lora_path"
            raise bad_request(str(e), param) from None
        self.adapters[name] = (int(lora_id), path)
        return int(lora_id)

    async def unload(self, body: UnloadLoRAAdapterRequest) -> None:
        name = body.lora_name
        if name not in self.adapters:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                           code="model_not_found")
        try:
            await self.engine.call(lambda e: e.remove_lora(name))
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        del self.adapters[name]


def add_lora_routes(app: FastAPI, adapters: ServedAdapters, base_name: str,
                    runtime_updates: bool) -> None:
    if not runtime_updates:
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load a PEFT LoRA folder (on the server's disk) and serve it as ``lora_name``."""
        await adapters.load(body, base_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Stop serving an adapter (400 while requests still run on it)."""
        await adapters.unload(body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")
