"""OpenAI-compatible HTTP server: ``kvserve serve`` (see docs/server.md).

``kvserve.server.api.build_app(engine_client, settings)`` builds the FastAPI app around an
``AsyncLLMEngine``; nothing heavy is imported here so ``kvserve`` CLI startup stays fast.
"""
