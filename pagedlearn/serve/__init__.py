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
key, a bug's 500), ``api_server`` (the routes, their errors, streaming). This file starts them
-- the engine loop on its thread, uvicorn on another -- and returns a :class:`ServerHandle`.

The context it serves is the model's, or what the block pool holds if that is less
(``num_blocks * block_size`` tokens; ``srv.max_model_len``, and ``/v1/models`` says it): a
request longer than the pool could never run. vLLM refuses to start with a pool that small;
pagedlearn's small pools are the point of the course, so it serves what fits and says so.

The web stack is the ``[serve]`` extra (``pip install "pagedlearn[serve]"``); it is imported only
when a server starts, so the rest of pagedlearn runs without it.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import threading
import time

from pagedlearn.errors import PagedLearnError

SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")
DEFAULT_PORT = 8000  # vLLM's
START_TIMEOUT = 60.0  # seconds uvicorn may take to start listening


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
        owns_llm: bool = False,
    ) -> None:  # fmt: skip
        self.llm, self.engine, self.model_name = llm, llm.engine, model_name
        self.max_model_len = max_model_len
        self.url, self.base_url = url, url + "/v1"
        self._loop, self._server, self._thread = loop, server, thread
        self._owns_llm = owns_llm  # built by serve(): its tensor-parallel workers stop with it
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
    **llm_kwargs,
) -> ServerHandle:
    """Start serving ``model`` (a name :class:`~pagedlearn.LLM` loads, with ``llm_kwargs``; or an
    ``LLM`` already built, whose engine the server then owns until ``stop()``) on
    ``host:port`` (``port=0``: a free port) and return once it listens. ``api_key``: required
    as ``Authorization: Bearer`` on ``/v1/*``. ``served_model_name``: the name clients send
    (default: the model's). A ``block_size`` longer than the model's context raises
    ``demo.OptionError``, as the demo does."""
    _require()
    import uvicorn

    from pagedlearn.engine.llm import LLM
    from pagedlearn.serve.api_server import build_app
    from pagedlearn.serve.engine_loop import EngineLoop

    if isinstance(model, LLM) and llm_kwargs:
        raise PagedLearnError(
            f"serve() got an LLM and LLM options ({', '.join(llm_kwargs)}): give one or the other"
        )
    sock = _bind(host, port)  # first: a port in use fails before a model is loaded
    loop = llm = None
    owns = not isinstance(model, LLM)
    try:
        llm = model if not owns else _load(model, llm_kwargs)
        name = served_model_name or str(llm.model_name)
        context = _served_context(llm, verbose=llm_kwargs.get("verbose", True))
        loop = EngineLoop(llm.engine).start()
        app = build_app(loop, name, context, api_key)
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
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
        if owns and llm is not None:
            llm.shutdown()
        sock.close()
        raise
    bound = sock.getsockname()[1]
    return ServerHandle(llm, loop, server, thread, _url(host, bound), name, context, owns)


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


# --- the command line -----------------------------------------------------------------------------
def add_arguments(parser) -> None:
    """The ``serve`` command's options (``python -m pagedlearn serve --help``): the demo's own
    checks and words where the two share an option."""
    from pagedlearn.__main__ import add_engine_options, int_in

    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (SmolLM2-135M-Instruct, offline: a real chat template), tiny-gpt2 (offline, "
        "random weights), gpt2, facebook/opt-125m, a path",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    port = int_in(0, 65535)
    parser.add_argument("--port", type=port, default=DEFAULT_PORT, help="0: any free port")
    parser.add_argument(  # never the key as its default: --help would print it
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDLEARN_API_KEY if set, "
        "else none: open)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients send (default: --model's)"
    )
    add_engine_options(
        parser,
        num_blocks_help="blocks in the pool (default: what LLM sizes from the memory budget); a "
        "pool of fewer tokens than the model's context serves a context of what it holds",
    )
    parser.add_argument(
        "--max-num-seqs", type=int_in(1), default=64, help="sequences one step may run"
    )
    parser.add_argument(
        "--swap-blocks", type=int_in(0), default=None,
        help="blocks in the CPU swap pool (default: as many as the pool with --preemption-mode "
        "swap, else none)",
    )  # fmt: skip


def cli(args) -> int:
    """``python -m pagedlearn serve``: serve until Ctrl-C or SIGTERM (``kill``; a background
    ``serve &`` of a non-interactive shell ignores Ctrl-C's SIGINT). Exit 2 for an option the
    model rules out (as the demo), 1 if it cannot start."""
    from pagedlearn.cli.demo import OptionError

    env_key = os.environ.get("PAGEDLEARN_API_KEY") or None
    api_key = args.api_key or env_key
    try:
        srv = serve(
            args.model,
            host=args.host,
            port=args.port,
            api_key=api_key,
            served_model_name=args.served_model_name,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            preemption_mode=args.preemption_mode,
            attention_backend=args.backend,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            swap_blocks=args.swap_blocks,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except OptionError as e:  # a usage error, reported with serve's usage, as the demo does
        from pagedlearn.__main__ import build_parser

        build_parser()[1]["serve"].error(f"argument --{e.option.replace('_', '-')}: {e}")
    except PagedLearnError as e:
        print(f"serve stopped: {e}", file=sys.stderr)
        return 1
    key = "$PAGEDLEARN_API_KEY" if not args.api_key else "KEY"
    auth = f' -H "Authorization: Bearer {key}"' if api_key else ""  # (never the key itself)
    body = f'{{"model": "{srv.model_name}", "prompt": "Hello, my name is", "max_tokens": 16}}'
    print(f"pagedlearn: serving {srv.model_name} at {srv.base_url} (Ctrl-C stops it)", flush=True)
    print(
        f"  try: curl {srv.base_url}/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'",
        flush=True,  # a log file or a pipe sees where it listens now, not at exit
    )
    on_main = threading.current_thread() is threading.main_thread()  # (signals: there only)
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    try:
        srv.wait()
    except KeyboardInterrupt:
        print("pagedlearn: stopping", flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        srv.stop()
    return 0


def _interrupt(signum, frame) -> None:
    """SIGTERM: stop as Ctrl-C does."""
    raise KeyboardInterrupt


__all__ = ["ServeUnavailableError", "ServerHandle", "add_arguments", "cli", "serve"]
