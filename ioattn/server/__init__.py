"""The OpenAI-compatible server: `ioattn serve --model PATH|smollm2|tiny --port 8000`, or
`create_app(EngineSpec(model, config))` for uvicorn.

Two processes: this one serves HTTP (routes, request checks, tokenization and detokenization, SSE), an engine-core
process spawned by it owns the `LLMEngine` and runs its steps; they talk over ZeroMQ with msgpack messages.
Modules: `app` (routes and request checks), `security` (limits, API key, content type, body size), `client` (the
HTTP side of the engine: requests, aborts, the engine process's life), `core` (the engine process), `transport`
(the messages and sockets between them), `detokenize` (token ids -> text and stop strings), `protocol` (request and
response bodies), `responses` (outputs -> bodies and stream chunks), `chat_template`, `metrics`, `cli`.
Needs the `server` extras: fastapi, uvicorn, prometheus-client, jinja2, pyzmq, msgspec.
"""
