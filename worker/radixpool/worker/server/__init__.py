"""The worker's HTTP server: OpenAI-compatible and native APIs over one `Engine`.

Layout, one concept per module:
- `config`: the `radixpool worker` flags and the frozen `ServerConfig` they become.
- `errors`: OpenAI-style error bodies; every 4xx names the offending field.
- `openai_protocol`: request models of `/v1/chat/completions` and `/v1/completions`.
- `state`: what the routes share (engine, lifecycle, metrics) and prompt checks.
- `generation`: runs one request on the engine and records its metrics.
- `openai_api`, `native_api`, `kv_events`: the routes; `sse`, `logprobs`: response shapes.
- `lifecycle`: loading → ready → draining; the ASGI gate (API key, 503s, in-flight count).
- `metrics`: Prometheus collectors built from `radixpool.protocol.metrics`.
- `app`: wires the routes; `serve`: runs uvicorn and the engine, drains on SIGTERM.

Nothing here imports torch at module import time; only `serve` loads the engine.
"""
