"""What one client may cost the server: the limits, and the HTTP protocol that enforces them.

A server that reads whatever a client sends, for as long as it takes, can be stalled by one
client: a 50 MB body is read, parsed and tokenized before its 400; a client that sends one header
line every few seconds (*slowloris*) holds a connection, a file descriptor, forever; a few hundred
such connections use up the process's file descriptors (``ulimit -n``), and then nobody, not
even ``/health``, gets in. vLLM fixed the same class of problem as CVE-2025-48956 by bounding the
size and number of the request's headers in h11, the HTTP parser uvicorn runs. Here each limit
is one field of :class:`ServerLimits`, on by default, with its flag in ``serve --help``:

================  ==================  ========================================================
field             default             what a request over it gets
================  ==================  ========================================================
max_body_bytes    16 MiB              413, as soon as its ``Content-Length`` says so (or, sent
                                      in chunks, as soon as that many bytes have arrived)
max_header_bytes  16 KiB (h11's)      431: the request line and headers together
max_headers       100                 431
header_timeout    10 s                408 if the headers are not all in by then (a connection
                                      that sent nothing is just closed)
body_timeout      60 s                408 if the body is not all in that long after the headers
max_connections   1024, or fewer      a new connection past it closes the oldest one that has
                  (below ulimit -n)   no request in progress (idle, or still sending its
                                      headers); if every one has, the newcomer gets a 503
================  ==================  ========================================================

Every refusal is OpenAI's error shape (middleware.py) with ``Connection: close``. The refusals
happen in the HTTP protocol, before the app sees the request: :class:`LimitedH11Protocol` is
uvicorn's h11 protocol (``uvicorn.Config(http=...)``) with the checks uvicorn does not have --
it has no header timeout at all, and its ``limit_concurrency`` answers 503 only once a request's
headers are in, so connections that never finish them are never refused. The checks see each
event h11 parses (:class:`_CheckedConnection`): a request's headers, then its body's pieces.

Why these defaults: the longest legitimate body is a prompt as long as the served context. At
128k tokens -- more than any model the course serves -- that is about 1 MB of token ids or
0.5 MB of text (3 MB if every character is JSON-escaped, as ``\\u00e9``); chat messages must fit
the same context, ``logit_bias`` is refused unless empty, OpenAI allows 4 stop strings. 16 MiB
is 5x the worst of those, and parsing 16 MiB of JSON takes a fraction of a second. An OpenAI
client sends about 15 headers, 1 KiB. ``max_connections`` stays below ``ulimit -n`` (the files
the process has open at start, and 64 spare, are taken off), so ``accept()`` does not fail
for want of a file descriptor; if it does anyway, :class:`QuietAcceptServer` logs one line
every 10 s instead of asyncio's traceback per attempt (Python < 3.13 logs one for each of up
to 2048 attempts per wake-up).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import math
import os
import time
from dataclasses import dataclass, fields
from http import HTTPStatus

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedlearn.errors import PagedLearnError
from pagedlearn.serve import (  # (the defaults are there: the CLI's help needs them, not h11)
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    MAX_HEADERS,
)
from pagedlearn.serve.middleware import error_response

logger = logging.getLogger("pagedlearn.serve")

MAX_CONNECTIONS = 1024  # the engine runs 64 sequences at a time by default: the rest only wait
FD_SPARE = 64  # files the process may still open while it serves (models, logs, pipes)
LINGER = 2.0  # seconds a refused connection's unread data is still read and dropped (below)


class LimitError(PagedLearnError, ValueError):
    """A limit that cannot be one (not a positive number); ``option`` names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class ServerLimits:
    """The limits one server enforces (module docstring: what each refuses, and why)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_header_bytes: int = MAX_HEADER_BYTES
    max_headers: int = MAX_HEADERS
    header_timeout: float = HEADER_TIMEOUT  # seconds
    body_timeout: float = BODY_TIMEOUT  # seconds
    max_connections: int | None = None  # None: default_max_connections()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_connections":
                object.__setattr__(self, f.name, default_max_connections())
                continue
            kind = int if f.type.startswith("int") else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not 0 < value < math.inf:
                what = "an integer" if kind is int else "a number of seconds"
                raise LimitError(f.name, f"{f.name} must be {what} > 0, got {value!r}")


def default_max_connections() -> int:
    """:data:`MAX_CONNECTIONS`, or fewer: what ``ulimit -n`` leaves once the files open now and
    :data:`FD_SPARE` more are counted."""
    try:
        import resource  # (Unix only)

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return MAX_CONNECTIONS
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    try:
        in_use = len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))
    except OSError:
        in_use = FD_SPARE
    return max(1, min(MAX_CONNECTIONS, soft - in_use - FD_SPARE))


def protocol_class(limits: ServerLimits):
    """What ``uvicorn.Config(http=...)`` takes: :class:`LimitedH11Protocol` bound to ``limits``
    and to one server's table of connections waiting for a request (oldest first)."""
    return functools.partial(LimitedH11Protocol, limits=limits, waiting={})


class _CheckedConnection(h11.Connection):
    """h11's connection, each parsed event passed through ``check`` first (an h11 error too):
    ``check`` returns the event, or ``NEED_DATA`` once it has refused the request -- uvicorn
    then waits for data that is never read, and creates no task for the request."""

    def __init__(self, check, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self._check = check

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:  # (uvicorn would answer a plain-text 400)
            event = e
        return self._check(event)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (one per connection) with :class:`ServerLimits` enforced.

    A request is read in two phases, each with its deadline (one timer): its *head* (request
    line and headers) from the moment the connection opens or the first byte of a following
    request arrives, then its *body*. Between requests a kept-alive connection is idle, and
    uvicorn's own keep-alive timeout (5 s) closes it."""

    def __init__(self, *args, limits: ServerLimits, waiting: dict, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self._waiting = limits, waiting
        self.conn = _CheckedConnection(self._checked, limits.max_header_bytes)
        self._phase: str | None = None  # "head", "body" or None: what the timer waits for
        self._timer: asyncio.TimerHandle | None = None
        self._fresh = True  # no request read yet on this connection
        self._body_bytes = 0
        self._over_cap = False  # opened past max_connections: its request gets a 503
        self._refused = False

    # --- the connection's life -------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._follow()
        # Over the cap: close the connections that have no request in progress, oldest first
        # (a slowloris client's, or idle ones); a newcomer that finds none gets a 503.
        excess = sum(not c.transport.is_closing() for c in self.connections)
        excess -= self.limits.max_connections
        for victim in list(self._waiting):
            if excess <= 0:
                break
            if victim is not self:
                victim._refuse(503, "the server is at its connection limit and this connection "
                               "had no request in progress", quiet_if_idle=True)  # fmt: skip
                excess -= 1
        self._over_cap = excess > 0

    def data_received(self, data: bytes) -> None:
        if self._refused:  # refused: what still arrives is dropped (see _refuse)
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (reads a pipelined request that waited, if any)
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        self._waiting.pop(self, None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Set the timer and the waiting table from h11's view of the client's side."""
        if self._refused:
            return
        state = self.conn.their_state
        if state is h11.IDLE and (self._fresh or self.conn.trailing_data[0]):
            self._set_phase("head")  # (a kept-alive connection's next request has begun)
        elif state is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)
        if state is h11.IDLE:  # no request in progress: may be closed for a newcomer
            self._waiting.setdefault(self)
        else:
            self._waiting.pop(self, None)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # (a deadline runs from the phase's start, not from the last byte)
        if self._timer is not None:
            self._timer.cancel()
        self._phase, self._timer = phase, None
        if phase is not None:
            limit = self.limits.header_timeout if phase == "head" else self.limits.body_timeout
            self._timer = self.loop.call_later(limit, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self._phase == "head":
            limit, flag, what = self.limits.header_timeout, "--header-timeout", "headers"
        else:
            limit, flag, what = self.limits.body_timeout, "--body-timeout", "body"
        message = f"the request's {what} did not arrive within {limit:g} s ({flag})"
        self._refuse(408, message, quiet_if_idle=True)

    # --- the checks, on each event h11 parses ------------------------------------------------
    def _checked(self, event):
        if self._refused:
            return h11.NEED_DATA
        lim = self.limits
        if isinstance(event, h11.RemoteProtocolError):
            if event.error_status_hint == 431:  # h11: a head still incomplete at this size
                self._refuse(431, self._head_too_large())
            else:
                self._refuse(event.error_status_hint, f"invalid HTTP request: {event}")
        elif isinstance(event, h11.Request):
            self._fresh, self._body_bytes = False, 0
            length = next((int(v) for k, v in event.headers if k == b"content-length"), 0)
            if len(event.headers) > lim.max_headers:
                self._refuse(431, f"the request has {len(event.headers)} headers, more than "
                             f"{lim.max_headers} (--max-headers)")  # fmt: skip
            elif _head_bytes(event) > lim.max_header_bytes:  # (arrived whole, in one read)
                self._refuse(431, self._head_too_large())
            elif length > lim.max_body_bytes:
                self._refuse(413, f"the request body is {length} bytes, more than the server "
                             f"takes: {lim.max_body_bytes} (--max-body-bytes)")  # fmt: skip
            elif self._over_cap:
                self._refuse(503, f"the server is at its connection limit ({lim.max_connections} "
                             "connections, --max-connections); try again later")  # fmt: skip
        elif isinstance(event, h11.Data):  # (a chunked body has no Content-Length to check)
            self._body_bytes += len(event.data)
            if self._body_bytes > lim.max_body_bytes:
                self._refuse(413, f"the request body is more than {lim.max_body_bytes} bytes, "
                             "what the server takes (--max-body-bytes)")  # fmt: skip
        return h11.NEED_DATA if self._refused else event

    def _head_too_large(self) -> str:
        return (f"the request line and headers are over {self.limits.max_header_bytes} bytes "
                "(--max-header-bytes)")  # fmt: skip

    def _refuse(self, status: int, message: str, quiet_if_idle: bool = False) -> None:
        """Answer ``status`` in OpenAI's shape (unless a response has started, or ``quiet_if_idle``
        and no byte of a request arrived: then just close), then close the connection.

        Closing a socket with unread data makes the kernel reset it, and a client still sending
        (most send the whole body before they read) would see the reset, not the answer. So the
        answer goes out with a FIN, and what the client still sends is read and dropped for
        :data:`LINGER` seconds, or until it closes its side (nginx's *lingering close*)."""
        if self._refused:
            return
        self._refused = True
        self._set_phase(None)
        self._waiting.pop(self, None)
        if self.transport.is_closing():
            return
        idle = self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]
        answered = self.cycle is not None and self.cycle.response_started
        if answered or (quiet_if_idle and idle):
            self.transport.close()
            return
        body = error_response(status, message).body
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json"
                f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
        self.transport.write(head.encode("ascii") + body)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.transport.resume_reading()  # (uvicorn pauses reading while the app is behind)
        self.loop.call_later(LINGER, self.transport.close)


def _head_bytes(request: h11.Request) -> int:
    """The size of ``request``'s head as sent (give or take optional spaces). h11 bounds only a
    head that is still incomplete: one that arrives whole in a single read is parsed whatever
    its size."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(k) + len(v) + len(b": \r\n") for k, v in request.headers) + 2


class QuietAcceptServer(uvicorn.Server):
    """uvicorn's server, with one change to its event loop: a failed ``accept()`` for want of
    file descriptors is logged as one line every 10 s, not as asyncio's traceback per attempt
    (which, for a few hundred waiting connections, writes tens of MB of log a minute)."""

    async def startup(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(functools.partial(_accept_errors, last=[float("-inf")]))
        await super().startup(sockets=sockets)


def _accept_errors(loop, context: dict, last: list) -> None:
    exc = context.get("exception")
    out_of = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
    if not (isinstance(exc, OSError) and exc.errno in out_of and "accept" in context["message"]):
        loop.default_exception_handler(context)
        return
    if time.monotonic() - last[0] >= 10.0:
        last[0] = time.monotonic()
        logger.warning(
            "pagedlearn: cannot accept connections (%s); lower --max-connections or raise "
            "`ulimit -n` (this is said at most every 10 s)",
            exc.strerror or exc,
        )
