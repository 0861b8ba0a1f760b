"""The HTTP side: a FastAPI app with OpenAI's routes over an :class:`EngineLoop` (vLLM 0.33's
``build_app`` in ``entrypoints/launchers/app.py`` and the routes it mounts, small).

::

    POST /v1/completions        ┐  body checked (protocol.py) ─> prompt token ids ─> SamplingParams
    POST /v1/chat/completions   ┘  ─> loop.add_request ─> stream ─> one JSON body, or SSE chunks
    GET  /v1/models                the one model served
    GET  /health                   200, or 503 once the engine is broken or stopped
    GET  /metrics                  Prometheus text, read on the engine thread (loop.call), one
                                   read shared by the scrapes that wait for it (SharedRead)

Streaming is Server-Sent Events: ``data: {chunk}\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` last.
A client that goes away is noticed at once (uvicorn tells the app): a stream's generator is
cancelled by Starlette, a non-streaming request is raced against the disconnect
(:func:`_unless_disconnected`, as ``with_cancellation`` in vLLM's
``entrypoints/serve/utils/api_utils.py``); either way the request is aborted on the engine and
its blocks go back to the pool. Every chunk's JSON escapes U+2028, U+2029 and U+0085: clients
that split the stream with ``str.splitlines`` (httpx's ``iter_lines``) end a line at them.

A request reaches these routes only within the server's limits (limits.py: body size, header
size and count, header and body timeouts, connections), checked in the HTTP protocol before the
app sees it. A text prompt longer than the served context could hold in any tokenization
(``request_checks.check_prompt_chars``) is refused before it is tokenized; a shorter one's chat
template and tokenization run on a worker thread, not on the event loop: a long prompt does not
stall the other clients, ``/health`` included. Parsing the body (pydantic) stays on the event
loop, its cost bounded by the body limit.

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the HTTP status: a bad body is a 400 naming the field (never FastAPI's 422; a body sent without
``Content-Type: application/json`` is one too, as in vLLM), an unknown model a 404, a wrong or
missing ``Authorization: Bearer`` key a 401 on every route but ``/health`` when the server
has a key (middleware.py says why ``/metrics`` and the docs are guarded where vLLM leaves them
open), a stopped or broken engine a 503. A message quotes only a prefix of what the client sent
(middleware.py's ``preview``). A failure of the engine while streaming arrives as a last
``data: {"error": ...}`` event.
A bug in the server is a JSON 500 too, logged once with its traceback (middleware.py), and the
connection stays open: Starlette's own handler would send the 500 and then raise again, and
uvicorn would close the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedlearn.engine.admission import RequestRejectedError
from pagedlearn.engine.prometheus import prometheus_text
from pagedlearn.models.tokenizer import max_chars_per_token
from pagedlearn.serve.auth import check_api_key
from pagedlearn.serve.chat import chat_prompt_ids
from pagedlearn.serve.engine_loop import (
    EngineDeadError,
    EngineLoop,
    RequestLostError,
    RequestStream,
)
from pagedlearn.serve.middleware import (
    ApiKeyMiddleware,
    InternalErrorMiddleware,
    error_body,
    error_response,
    preview,
)
from pagedlearn.serve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from pagedlearn.serve.request_checks import check_pool, check_prompt_chars
from pagedlearn.serve.responses import Reply

logger = logging.getLogger("pagedlearn.serve")


def build_app(
    loop: EngineLoop, model_name: str, max_model_len: int, api_key: str | None = None
) -> FastAPI:
    """The app: OpenAI's routes serving ``model_name`` from ``loop``'s engine, with a context of
    ``max_model_len`` tokens (what serve() serves: at most what the pool holds)."""
    app = FastAPI(title="pagedlearn", summary="PagedAttention, small: an OpenAI-compatible server")
    tokenizer = loop.engine.tokenizer
    vocab_size = loop.engine.model.config.vocab_size  # token ids sent must be below it
    chars_per_token = max_chars_per_token(tokenizer)  # what a prompt of the context can be
    tokenizing = threading.Lock()  # (tokenize() below)
    started = int(time.time())  # /v1/models' "created": when this server started serving it
    _install_error_handlers(app)
    app.add_middleware(InternalErrorMiddleware)
    if api_key is not None:  # ("": ApiKeyError, never an open server)
        app.add_middleware(ApiKeyMiddleware, api_key=check_api_key(api_key))

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ProtocolError(f"The model `{name}` does not exist.", "model", 404)

    @app.get("/health")
    async def health() -> Response:
        if loop.error:
            return error_response(503, loop.error)
        return Response(status_code=200)

    metrics_page = SharedRead(loop, lambda engine: prometheus_text(engine, model_name))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await metrics_page(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "pagedlearn",
            "root": str(loop.engine.model_name),
            "parent": None,
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)

        prompt = body.one_prompt(vocab_size)
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), max_model_len, chars_per_token)

        def prompt_ids() -> list[int]:
            return list(tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt

        # Tokenized here, not on the engine thread, so that the context check can say the
        # prompt's length (the engine only ever sees ids).
        return await serve_one(raw, body, "completion", await tokenize(prompt_ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        messages = body.chat_messages()
        chars = sum(len(m["content"]) for m in messages)  # (the template adds more)
        check_prompt_chars(chars, max_model_len, chars_per_token, "messages")
        ids = await tokenize(lambda: chat_prompt_ids(tokenizer, messages))
        return await serve_one(raw, body, "chat", ids)

    async def tokenize(fn) -> list[int]:
        """``fn()`` -- a prompt's template and tokenization -- on a worker thread: a prompt as
        long as check_prompt_chars lets through takes seconds to tokenize, and on the event
        loop it would stall every other client, ``/health`` too. One at a time (the lock): the
        tokenizer is shared with the engine thread, which only decodes, and a Hugging Face
        tokenizer encodes and decodes from two threads safely as long as nobody changes its
        truncation or padding settings."""

        def locked() -> list[int]:
            with tokenizing:
                return fn()

        return await asyncio.to_thread(locked)

    async def serve_one(raw: Request, body, kind: str, ids: list[int]) -> Response:
        """Both endpoints from here: the prompt's token ids in, one response out."""
        params = body.sampling_params(len(ids), max_model_len, vocab_size)
        check_pool(loop.engine.kv, len(ids), params, body.requested_max_tokens()[1])
        reply = Reply(kind, model_name, tokenizer, params.logprobs)
        stream_it = bool(body.stream)
        try:
            stream = await loop.add_request(reply.id, ids, params, body.cache_salt, stream_it)
        except RequestRejectedError as e:  # the engine's admission: the message names why
            why = str(e).replace(f"request {reply.id!r}", "this request")
            raise ProtocolError(why, "n" if "sequences" in why else "prompt") from None
        except (ValueError, TypeError) as e:  # what else the engine found wrong with the input
            raise ProtocolError(f"the engine refused this request: {e}") from None
        if stream_it:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _sse(stream, reply, params.n, usage)
            # (the background task: a client gone before the first chunk never starts _sse)
            done = BackgroundTask(stream.cancel)
            return StreamingResponse(events, media_type="text/event-stream", background=done)
        try:
            out = await _unless_disconnected(raw, _last(stream))
        finally:
            stream.cancel()  # (nothing, once the final output was read)
        if out is None:  # the client is gone: nobody reads this
            return Response(status_code=499)
        if failed := _failure(out):
            return error_response(500, failed)
        return JSONResponse(reply.response(out))

    return app


class SharedRead:
    """``await read()``: ``fn(engine)``'s result, read on the engine thread (``loop.call``), one
    read shared by every caller that arrives before it has started. ``/metrics`` is read so: a
    flood of scrapes costs the engine one read between two steps, not one per scrape, and each
    caller still gets a page read after it asked (never an older one)."""

    def __init__(self, loop: EngineLoop, fn) -> None:
        self._loop, self._fn = loop, fn
        self._next: tuple[asyncio.Future, list] | None = None  # (the read, [has it started?])

    async def __call__(self):
        if self._next is None or self._next[1][0]:
            started = [False]

            def read(engine):
                started[0] = True  # (engine thread) a caller from now on needs a read of its own
                return self._fn(engine)

            self._next = (asyncio.wrap_future(self._loop.call(read)), started)
        return await asyncio.shield(self._next[0])  # (a caller that leaves cancels only itself)


async def _last(stream: RequestStream):
    out = None
    async for out in stream:  # noqa: B007 (a non-streaming request: one, final output)
        pass
    return out


def _failure(out) -> str | None:
    """Why the engine failed ``out`` (finish reason "error"), or None."""
    if any(c.finish_reason == "error" for c in out.outputs):
        return out.error or "the engine failed this request"
    return None


async def _sse(stream: RequestStream, reply: Reply, n: int, include_usage: bool):
    """The SSE body of a streaming request. Cancelled when the client goes away: the
    ``finally`` aborts the request."""
    try:
        for chunk in reply.opening(n):
            yield _event(chunk)
        out = None
        async for out in stream:
            if failed := _failure(out):
                yield _event(error_body(500, failed))
                break
            for chunk in reply.chunks(out):
                yield _event(chunk)
        else:
            if include_usage and out is not None:
                yield _event(reply.usage_chunk(out))
    except Exception as e:  # the engine stopped or broke (EngineDeadError, RequestLostError)
        if not isinstance(e, (EngineDeadError, RequestLostError)):  # a bug: say where, once
            logger.exception("pagedlearn: internal error in a stream")
        status = 503 if isinstance(e, EngineDeadError) else 500
        yield _event(error_body(status, str(e)))
    finally:
        stream.cancel()
    yield "data: [DONE]\n\n"


# Characters that str.splitlines ends a line at and json.dumps leaves as they are (it escapes the
# control characters below U+0020 itself): a client splitting the stream that way (httpx's
# iter_lines) would cut a chunk's JSON in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def _unless_disconnected(raw: Request, work):
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (its
    ``finally`` aborts the request) and None is returned."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        media = content_type.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            # FastAPI did not read the body as JSON (vLLM refuses such a request too)
            got = f"Content-Type: {content_type}" if content_type else "no Content-Type"
            message = (
                f"the request body must be sent as JSON, with the header 'Content-Type: "
                f"application/json' (got {got})"
            )
            return error_response(400, message)
        param, message = describe_validation_error(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(ProtocolError)
    async def refused(request: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(EngineDeadError)
    async def dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(RequestLostError)
    async def lost(request: Request, exc: RequestLostError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # an unknown route (404), a method it does not take (405, with its Allow header), ...
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


def describe_validation_error(errors: list[dict]) -> tuple[str | None, str]:
    """pydantic's errors (FastAPI's ``RequestValidationError``) as ``(param, message)``: the
    field the first is about, and a sentence that names it. A field that takes several types
    (``prompt``: text or token ids) gets one error per type: they are said together."""
    err = errors[0]
    loc = _field_path(err)
    field = ".".join(loc) or None
    kind = err.get("type")
    if kind == "json_invalid":
        why = (err.get("ctx") or {}).get("error", err.get("msg"))
        return None, f"the request body is not valid JSON: {why}"
    if kind == "missing" and not loc:
        return None, "the request body is empty: send a JSON object"
    if kind == "model_attributes_type" and not loc:
        return None, f"the request body must be a JSON object, got {preview(err.get('input'))}"
    if kind == "extra_forbidden":
        return field, f"unknown field {preview(field)}: pagedlearn's server does not take it"
    if kind == "missing":
        return field, f"{field} is required"
    same = dict.fromkeys(e["msg"] for e in errors if _field_path(e) == loc)  # (ordered set)
    what = field or "the request body"
    return field, f"{what}: {' or '.join(same)} (got {preview(err.get('input'))})"


def _field_path(err: dict) -> list[str]:
    """An error's location without "body" and without pydantic's union tags (the name of the
    type it tried: ``str``, ``list[int]``, ``TextPart``)."""
    return [
        str(p)
        for p in err.get("loc", ())
        if p != "body" and not (isinstance(p, str) and _UNION_TAG.match(p))
    ]


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|\w+\[.*\])$")
