"""Many replicas behind one OpenAI endpoint: session-affinity and prefix-aware routing
(docs/replicas.md). ``kvserve router --replica URL ...`` and ``kvserve serve
--data-parallel-size N`` run it."""
