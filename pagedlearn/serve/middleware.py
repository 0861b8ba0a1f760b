"""What wraps every route of the server: OpenAI's error shape, the API key, and a bug's 500.

Every error the server sends is OpenAI's shape (:func:`error_body`)::

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}

``code`` is the HTTP status and ``type`` the name OpenAI's clients raise for it (the ``openai``
package turns a 400 into ``openai.BadRequestError``). It is written as ASCII JSON: a message may
quote what the client sent, and a lone surrogate (JSON's ``"\\ud800"``) has no UTF-8.

Two plain ASGI middlewares (no Starlette ``BaseHTTPMiddleware``: they never wrap a stream's
body in another task):

- :class:`ApiKeyMiddleware`: ``--api-key``, the check of vLLM's
  ``entrypoints/serve/middleware/authenticate.py``;
- :class:`InternalErrorMiddleware`: an exception no handler of the app took -- a bug -- becomes
  a JSON 500, logged once with its traceback, and the connection stays open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from http import HTTPStatus

from fastapi.responses import JSONResponse

logger = logging.getLogger("pagedlearn.serve")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote what the client sent,
    and a lone surrogate (JSON's ``"\\ud800"``) cannot be written as UTF-8."""

    def render(self, content) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, message: str, param: str | None = None, headers=None
) -> JSONResponse:
    body = error_body(status, message, param)
    return AsciiJSONResponse(body, status_code=status, headers=headers)


class ApiKeyMiddleware:
    """Refuse ``/v1/*`` without ``Authorization: Bearer <api_key>`` (401), as vLLM's
    ``--api-key`` does; ``/health`` and ``/metrics`` stay open. A plain ASGI middleware: it
    runs before the body is read, and never wraps a stream."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def _ok(self, scope) -> bool:
        headers = dict(scope.get("headers") or ())
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._digest)

    async def __call__(self, scope, receive, send) -> None:
        guarded = scope["type"] == "http" and scope.get("method") != "OPTIONS"
        if guarded and scope["path"].startswith("/v1") and not self._ok(scope):
            message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
            await error_response(401, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class InternalErrorMiddleware:
    """A bug in a route (an exception no handler of the app takes) answered as a JSON 500, logged
    once, with its traceback; the connection stays open for the client's next request. (Starlette's
    ``ServerErrorMiddleware`` sends its 500 and then raises again, for the server to log: uvicorn
    then prints "Exception in ASGI application" and closes the connection.) A plain ASGI
    middleware around the app's exception handlers: it sees only what they did not handle."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_note(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:
            logger.exception("pagedlearn: internal error in %s %s", scope["method"], scope["path"])
            if not started:  # (else half a response went out: uvicorn closes the connection)
                message = f"internal error: {type(exc).__name__}: {exc}"
                await error_response(500, message)(scope, receive, send)
