"""The HTTP plumbing the replica server (``kvserve.server``) and the router
(``kvserve.router``) both stand on: OpenAI-shaped errors, ASGI middleware, the listening socket
and the draining uvicorn server, the tokenizer pool and request tracing. It sits below both, so
neither of them imports the other (``tests/test_architecture.py``)."""
