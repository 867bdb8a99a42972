"""The server's limits (`ServerLimits`), and what every HTTP request passes before any route sees it (a pure ASGI
middleware, `RequestGuard`, so nothing is parsed first):

- the API key, when the server has one (`--api-key` or `IOATTN_API_KEY`): every `/v1/...` route wants
  `Authorization: Bearer KEY`, compared in constant time (`hmac.compare_digest`), else 401 with OpenAI's
  `invalid_api_key` error; /health, /metrics and /version stay open for probes and scrapers;
- a JSON content type on every POST (`application/json`, or any `+json` type), else 415 saying so. Besides
  telling a curl user who forgot `-H 'Content-Type: application/json'` what is wrong, it keeps browsers out: a
  web page can POST `text/plain` to 127.0.0.1 without asking, but not `application/json`;
- a size limit on request bodies, else 413 (checked against Content-Length first, and while reading).

The body, once read within the limit, is handed on as one message; later messages (a disconnect) pass through.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

API_PATH_PREFIX = "/v1/"


@dataclass(frozen=True)
class ServerLimits:
    max_queued_requests: int = 1024  # unfinished engine requests (one per prompt); more: 429
    max_prompts: int = 128  # prompts in one /v1/completions batch
    max_body_bytes: int = 16 << 20
    api_key: str | None = None  # None: no key asked

    def __post_init__(self):
        for name in ("max_queued_requests", "max_prompts", "max_body_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")


class RequestGuard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # lower-case names; a repeated header: its last value
        if self.api_key is not None and scope["path"].startswith(API_PATH_PREFIX):
            refusal = self._check_key(headers.get(b"authorization"))
            if refusal is not None:
                return await _error(send, 401, refusal, "invalid_api_key", {b"www-authenticate": b"Bearer"})
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        media_type = content_type.split(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            return await _error(send, 415, f"the request body must be JSON sent as Content-Type: application/json "
                                f"(this request has {got})", "unsupported_media_type")
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _error(send, 413, self._too_large(int(declared)), "request_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await _error(send, 413, self._too_large(size), "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await self.app(scope, replay, send)

    def _check_key(self, authorization: bytes | None) -> str | None:
        if not authorization:
            return ("you didn't provide an API key: send it in an Authorization header as a Bearer token "
                    "(Authorization: Bearer YOUR_KEY)")
        scheme, _, key = authorization.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
            return "incorrect API key provided"
        return None

    def _too_large(self, size: int) -> str:
        return f"the request body is {size} bytes or more, over this server's limit of {self.max_body_bytes} bytes"


async def _error(send, status: int, message: str, code: str, headers: dict[bytes, bytes] | None = None) -> None:
    """An OpenAI-style error body, written without the app (nothing has been routed yet)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            *(headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
