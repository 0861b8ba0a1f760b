"""An OpenAI-compatible HTTP server over the paged engine: ``python -m pagedlearn serve``.

vLLM is mostly used as a server (``vllm serve MODEL``) that speaks OpenAI's API; this package is
that server, small, on the same stack (FastAPI + uvicorn), so that any OpenAI client -- ``curl``,
the ``openai`` package, a load generator -- can drive pagedlearn's engine::

    from pagedlearn.serve import serve
    import openai
    with serve("tiny-gpt2", port=0) as srv:            # port=0: any free port
        client = openai.OpenAI(base_url=srv.base_url, api_key="none")
        out = client.completions.create(model=srv.model_name, prompt="Hello", max_tokens=8)
        srv.call(lambda engine: engine.stats())        # read live state on the engine thread

Read in this order: ``engine_loop`` (the one thread that owns the ``LLMEngine``; the HTTP side
talks to it by message), ``streams`` (one request's outputs on the asyncio side), ``protocol``
(what a request body may say, and its ``SamplingParams``), ``chat`` (messages -> one prompt),
``responses`` (OpenAI's bodies and stream chunks), ``middleware`` (OpenAI's error shape, the API
key, a bug's 500), ``api_server`` (the routes, their errors, streaming), ``limits`` (what one
client may cost the server). This file starts them -- the engine loop on its thread, uvicorn
on another -- and returns a :class:`ServerHandle`; ``python -m pagedlearn serve`` is its
command line (pagedlearn/cli/serve.py).

The server has limits, on by default, each a keyword of :func:`serve` and a flag of
``serve --help``: a body of at most 16 MiB (``max_body_bytes``; refused with a 413 before it is
read), a request line and headers of at most 16 KiB (``max_header_bytes``) and 100 headers
(``max_headers``; 431), 10 s to send the headers and 60 s more for the body
(``header_timeout``, ``body_timeout``; 408), and at most 1024 open connections, fewer if
``ulimit -n`` is lower (``max_connections``: past it the oldest connection with no request in
progress is closed, or the newcomer gets a 503). limits.py says why each default.

The context it serves is the model's, or what the block pool holds if that is less
(``num_blocks * block_size`` tokens; ``srv.max_model_len``, and ``/v1/models`` says it): a
request longer than the pool could never run. vLLM refuses to start with a pool that small;
pagedlearn's small pools are the point of the course, so it serves what fits and says so.

The web stack is the ``[serve]`` extra (``pip install "pagedlearn[serve]"``); it is imported only
when a server starts, so the rest of pagedlearn runs without it.
"""

from __future__ import annotations

import importlib
import socket
import sys
import threading
import time

from pagedlearn.errors import PagedLearnError

SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")
DEFAULT_PORT = 8000  # vLLM's
START_TIMEOUT = 60.0  # seconds uvicorn may take to start listening
# The limits' defaults (limits.py says why each; ``serve --help`` and the docstring above show
# them): defined here, not in limits.py, because the command line's help needs them without the
# web stack that limits.py imports.
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024  # h11's own default
MAX_HEADERS = 100
HEADER_TIMEOUT = 10.0  # seconds
BODY_TIMEOUT = 60.0  # seconds


class ServeUnavailableError(PagedLearnError, ImportError):
    """The web stack (FastAPI, uvicorn, ...) is not installed."""


def _require() -> None:
    missing = []
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ServeUnavailableError(
            f'the server needs {", ".join(missing)}: pip install "pagedlearn[serve]"'
        )


class ServerHandle:
    """A running server: where it listens, its engine, the context it serves
    (``max_model_len``), and :meth:`stop`."""

    def __init__(
        self, llm, loop, server, thread, url: str, model_name: str, max_model_len: int,
        owns_llm: bool = False, kv_events=None,
    ) -> None:  # fmt: skip
        self.llm, self.engine, self.model_name = llm, llm.engine, model_name
        self.max_model_len = max_model_len
        self.url, self.base_url = url, url + "/v1"
        self._loop, self._server, self._thread = loop, server, thread
        self._owns_llm = owns_llm  # built by serve(): its tensor-parallel workers stop with it
        self.kv_events = kv_events  # the KV-event publisher (kv_events/publisher.py), or None
        self._stopped = False

    def call(self, fn, timeout: float = 30.0):
        """``fn(engine)`` run on the engine thread between steps; returns its result (or raises
        its error). The way to read or change live state while the server runs."""
        return self._loop.call(fn).result(timeout)

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C raises ``KeyboardInterrupt`` out of it)."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking connections, abort what runs (their clients get an error), end both
        threads. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._server.should_exit = True  # uvicorn: stop accepting, finish what is in flight
        self._loop.stop(timeout)  # aborts every request: the streams end with an error
        self._thread.join(timeout)
        if self.kv_events is not None:  # after the engine's last step: its batch goes out
            self.kv_events.close()
        if self._owns_llm:
            self.llm.shutdown()  # an LLM the caller built is the caller's to shut down

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.model_name!r} at {self.url})"


def serve(
    model="smollm2",
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_headers: int = MAX_HEADERS,
    header_timeout: float = HEADER_TIMEOUT,
    body_timeout: float = BODY_TIMEOUT,
    max_connections: int | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
    kv_events_topic: str = "",
    **llm_kwargs,
) -> ServerHandle:
    """Start serving ``model`` (a name :class:`~pagedlearn.LLM` loads, with ``llm_kwargs``; or an
    ``LLM`` already built, whose engine the server then owns until ``stop()``) on
    ``host:port`` (``port=0``: a free port) and return once it listens. ``api_key``: required
    as ``Authorization: Bearer`` on every route but ``/health``; an empty or blank one raises
    ``auth.ApiKeyError`` (auth.py), and a ``host`` other than loopback without one prints a
    warning to stderr. ``served_model_name``: the name clients send
    (default: the model's). A ``block_size`` longer than the model's context raises
    ``demo.OptionError``, as the demo does.

    The limits (limits.py says what each refuses, and why its default): ``max_body_bytes``,
    ``max_header_bytes`` (request line and headers), ``max_headers`` (how many),
    ``header_timeout`` and ``body_timeout`` (seconds), ``max_connections`` (None: 1024, or
    fewer below ``ulimit -n``). A limit that is not a positive number raises
    ``limits.LimitError`` before anything starts.

    ``kv_events_endpoint``: publish the engine's KV-cache events there in vLLM's format
    (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` over ZeroMQ; a wildcard address
    such as ``tcp://*:5557`` is bound, any other connected to, as vLLM does), with a replay
    socket at ``kv_events_replay_endpoint`` if given (kv_events/publisher.py); the publisher is
    ``srv.kv_events``. Needs the ``[kv-events]`` extra."""
    _require()
    if kv_events_endpoint is not None:  # a missing extra fails before a model is loaded
        from pagedlearn.kv_events import import_extra

        for name in ("zmq", "msgspec"):
            import_extra(name)
    import uvicorn

    from pagedlearn.engine.llm import LLM
    from pagedlearn.serve.api_server import build_app
    from pagedlearn.serve.auth import check_api_key, exposure_warning
    from pagedlearn.serve.engine_loop import EngineLoop
    from pagedlearn.serve.limits import QuietAcceptServer, ServerLimits, protocol_class

    api_key = check_api_key(api_key)  # before anything starts: never half-configured
    if isinstance(model, LLM) and llm_kwargs:
        raise PagedLearnError(
            f"serve() got an LLM and LLM options ({', '.join(llm_kwargs)}): give one or the other"
        )
    limits = ServerLimits(
        max_body_bytes, max_header_bytes, max_headers, header_timeout, body_timeout,
        max_connections,
    )  # fmt: skip
    sock = _bind(host, port)  # first: a port in use fails before a model is loaded
    if warning := exposure_warning(host, api_key, sock.getsockname()[1]):
        print(warning, file=sys.stderr, flush=True)
    loop = llm = publisher = None
    owns = not isinstance(model, LLM)
    try:
        if kv_events_endpoint is not None:  # a bad address fails before a model is loaded
            from pagedlearn.kv_events.publisher import KVEventPublisher

            publisher = KVEventPublisher(
                kv_events_endpoint, kv_events_replay_endpoint, topic=kv_events_topic
            )
        llm = model if not owns else _load(model, llm_kwargs)
        name = served_model_name or str(llm.model_name)
        context = _served_context(llm, verbose=llm_kwargs.get("verbose", True))
        if publisher is not None:  # subscribed before the engine thread steps
            publisher.attach(llm.engine.kv)
        loop = EngineLoop(llm.engine).start()
        app = build_app(loop, name, context, api_key)
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
            http=protocol_class(limits),  # h11 with the limits checked (limits.py)
        )  # fmt: skip
        server = QuietAcceptServer(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="pagedlearn-http", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                raise PagedLearnError("the HTTP server did not start (see the log above)")
            time.sleep(0.01)
    except BaseException:
        if loop is not None:
            loop.stop()
        if publisher is not None:
            publisher.close()
        if owns and llm is not None:
            llm.shutdown()
        sock.close()
        raise
    bound = sock.getsockname()[1]
    return ServerHandle(
        llm, loop, server, thread, _url(host, bound), name, context, owns, publisher
    )


def _load(model, llm_kwargs: dict):
    """``LLM(model, **llm_kwargs)``, the block size checked against the model's context first,
    before the pool is allocated (the demo's check, with its error)."""
    from pagedlearn.cli.demo import check_block_size
    from pagedlearn.engine.llm import LLM
    from pagedlearn.models import LoadedModel, load

    kwargs = dict(llm_kwargs)
    if not isinstance(model, LoadedModel):
        model = load(model, kwargs.pop("tokenizer", None), kwargs.pop("dtype", None))
    block_size = kwargs.get("block_size", 16)
    if isinstance(block_size, int):  # (anything else: LLM's own check says what is wrong)
        check_block_size(model, block_size)
    return LLM(model, **kwargs)


def _served_context(llm, verbose: bool = True) -> int:
    """The context the server serves: the model's, or what the pool holds if that is less (a
    longer request could never run); said in one line when it is less."""
    engine = llm.engine
    blocks, size = engine.kv.allocator.num_blocks, engine.kv.block_size
    context = min(engine.max_model_len, blocks * size)
    if context < engine.max_model_len and verbose:
        print(
            f"pagedlearn: serving a context of {context} tokens, what the pool holds ({blocks} "
            f"blocks x {size} tokens; {llm.model_name}'s context is {engine.max_model_len})",
            flush=True,
        )
    return context


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``. Its protocol is named (IPPROTO_TCP, not 0):
    asyncio turns Nagle's algorithm off only on sockets that say they are TCP, and with it on,
    every response written in two pieces waits ~40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart at once on a port
        sock.bind((host, port))
        sock.listen(2048)
        return sock
    except OSError as e:
        sock.close()
        raise PagedLearnError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); pick another port "
            "(0: any free one) or host"
        ) from None


def _url(host: str, port: int) -> str:
    local = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{local}]:{port}" if ":" in local else f"http://{local}:{port}"


__all__ = ["ServeUnavailableError", "ServerHandle", "serve"]
