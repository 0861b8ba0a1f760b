"""What wraps every route of the server: OpenAI's error shape, the API key, and a bug's 500.

Every error the server sends is OpenAI's shape (:func:`error_body`)::

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}

``code`` is the HTTP status and ``type`` the name OpenAI's clients raise for it (the ``openai``
package turns a 400 into ``openai.BadRequestError``). It is written as ASCII JSON: a message may
quote what the client sent, and a lone surrogate (JSON's ``"\\ud800"``) has no UTF-8. A message
quotes only a prefix of a client's value (:func:`preview`), and :func:`error_body` cuts any
message and ``param`` that is still too long (:func:`clip`): a 10 MB value never makes a 10 MB
error.

Two plain ASGI middlewares (no Starlette ``BaseHTTPMiddleware``: they never wrap a stream's
body in another task):

- :class:`ApiKeyMiddleware`: the API key (auth.py says where it comes from and what it may be),
  checked as vLLM's ``entrypoints/serve/middleware/authenticate.py`` does, on every route but
  ``/health``;
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

from pagedlearn.serve.auth import check_api_key

logger = logging.getLogger("pagedlearn.serve")

PREVIEW_CHARS = 80  # how much of a rejected value an error message quotes
MAX_MESSAGE_CHARS = 2000  # the longest error message sent (error_body cuts there)
MAX_PARAM_CHARS = 200  # a param is a field's path: it may hold a client's dict key

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape; a message or param too long is cut (``clip``), whoever made it."""
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    param = None if param is None else clip(param, MAX_PARAM_CHARS)
    return {"error": {"message": clip(message), "type": kind, "param": param, "code": status}}


def preview(value, limit: int = PREVIEW_CHARS) -> str:
    """``repr(value)``, cut to its first ``limit`` characters (then ``...`` and the value's
    length) and computed no further: what an error message quotes of a client's value, so that
    a 10 MB value gets a short 400, and makes no 10 MB string on the way."""
    out, size = [], 0
    for piece in _repr_pieces(value, limit, 0):
        out.append(piece)
        size += len(piece)
        if size > limit:
            cut = "".join(out)[:limit]
            if isinstance(value, (str, list, tuple, dict)):
                unit = "characters" if isinstance(value, str) else "items"
                return f"{cut}... ({len(value):,} {unit})"
            return cut + "..."
    return "".join(out)


def _repr_pieces(value, limit: int, depth: int):
    """``repr(value)`` in pieces, lazily (:func:`preview` stops reading once it has enough)."""
    if isinstance(value, str):
        yield repr(value[: limit + 1])  # (a prefix: never the whole string)
    elif isinstance(value, (list, tuple, dict)):
        if depth > 8:  # (deeper than any message needs: no recursion to exhaust)
            yield "..."
            return
        is_dict = isinstance(value, dict)
        yield "{" if is_dict else "["
        for i, item in enumerate(value.items() if is_dict else value):
            if i:
                yield ", "
            if is_dict:
                yield from _repr_pieces(item[0], limit, depth + 1)
                yield ": "
                item = item[1]
            yield from _repr_pieces(item, limit, depth + 1)
        yield "}" if is_dict else "]"
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        yield f"<an int of {value.bit_length()} bits>"  # (str() of a huge int is slow)
    else:
        yield repr(value)


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message``, cut to ``limit`` characters with a note saying so: the last line of
    defence against an error that quotes a whole client value (:func:`error_body`)."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... (message cut: {len(message):,} characters)"


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


OPEN_PATHS = frozenset({"/health"})  # what answers without the key


class ApiKeyMiddleware:
    """Refuse every route but ``/health`` without ``Authorization: Bearer <api_key>`` (401): the
    ``/v1`` API, ``/metrics``, the docs (``/docs``, ``/redoc``, ``/openapi.json``), and any path
    the app does not have (401, not 404: deny by default, so a route added later is guarded from
    the start). A plain ASGI middleware: it runs before the body is read, and never wraps a
    stream. The key is compared as a SHA-256 digest with ``hmac.compare_digest``: the time it
    takes says nothing about how much of a guess was right.

    vLLM guards less: its middleware checks only the API's prefixes (``/v1``, ``/v2``,
    ``/inference``, ...; its security guide lists the rest as unauthenticated), and the newer
    one that guards every route still leaves ``/metrics`` and the docs public. pagedlearn
    guards them: ``/metrics`` shows how the server is used (requests, tokens, what the prefix
    cache finds) and is computed on the engine thread, so anyone could slow generation by
    asking for it in a loop; Prometheus sends the key with ``authorization: {credentials_file:
    ...}`` in its scrape config. The docs say nothing a client with the key cannot read, and a
    browser cannot send the header: read them on a server without a key (on 127.0.0.1), or with
    ``curl -H``. ``/health`` stays open: load balancers and orchestrators probe it without
    credentials. ``OPTIONS`` passes, as in vLLM (a CORS preflight carries no credentials)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        api_key = check_api_key(api_key)  # (an empty or blank key: ApiKeyError, never open)
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def _ok(self, scope) -> bool:
        headers = dict(scope.get("headers") or ())
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._digest)

    async def __call__(self, scope, receive, send) -> None:
        guarded = scope["type"] == "http" and scope.get("method") != "OPTIONS"
        if guarded and scope["path"] not in OPEN_PATHS and not self._ok(scope):
            message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
            challenge = {"WWW-Authenticate": "Bearer"}  # (HTTP's 401 names its scheme)
            await error_response(401, message, headers=challenge)(scope, receive, send)
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
