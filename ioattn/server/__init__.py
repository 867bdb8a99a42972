"""The OpenAI-compatible server: `ioattn serve --model PATH|tiny --port 8000`, or `create_app(engine)` for uvicorn.

Modules: `app` (routes and request checks), `engine_loop` (the single owner of the engine), `protocol` (request and
response bodies), `responses` (engine outputs -> bodies and stream chunks), `chat_template`, `metrics`, `cli`.
Needs the `server` extras: fastapi, uvicorn, prometheus-client, jinja2.
"""
