"""``python -m pagedlearn serve``: the command line of the server (:mod:`pagedlearn.serve`).

Its options are ``serve()``'s keywords: the model and the engine's pool (the demo's own checks
and words where the two share an option), the API key (serve/auth.py: from a flag, a file or the
environment), and the limits on what one client may cost the server (serve/limits.py says why
each default). It prints where it listens, a ``curl`` line to try, and serves until Ctrl-C or
SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading

from pagedlearn.errors import PagedLearnError
from pagedlearn.serve import (
    BODY_TIMEOUT,
    DEFAULT_PORT,
    HEADER_TIMEOUT,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    serve,
)


def add_arguments(parser) -> None:
    """The ``serve`` command's options (``python -m pagedlearn serve --help``): the demo's own
    checks and words where the two share an option."""
    from pagedlearn.__main__ import add_engine_options, int_in
    from pagedlearn.serve.auth import add_auth_arguments

    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (SmolLM2-135M-Instruct, offline: a real chat template), tiny-gpt2 (offline, "
        "random weights), gpt2, facebook/opt-125m, a path",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    port = int_in(0, 65535)
    parser.add_argument("--port", type=port, default=DEFAULT_PORT, help="0: any free port")
    add_auth_arguments(parser)  # --api-key, --api-key-file (auth.py)
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
    add_limit_options(parser)
    add_kv_events_options(parser)


def add_kv_events_options(parser) -> None:
    """Publishing the engine's KV-cache events in vLLM's format (kv_events/publisher.py)."""
    group = parser.add_argument_group(
        "KV-cache events", "publish every block the prefix cache stores or evicts in vLLM's "
        "format (BlockStored / BlockRemoved / AllBlocksCleared, msgpack over ZeroMQ), for "
        "`python -m pagedlearn kv-events` or any tool written for vLLM's stream; needs the "
        '[kv-events] extra: pip install -e ".[kv-events]"',
    )  # fmt: skip
    group.add_argument(
        "--kv-events-endpoint", default=None, metavar="ENDPOINT",
        help="ZeroMQ address of the PUB socket, e.g. tcp://*:5557 (vLLM's default); a wildcard "
        "(*), :: or ipc:// address is bound and subscribers connect to it, any other address "
        "is connected to (the subscriber binds it), as vLLM does (default: no events)",
    )  # fmt: skip
    group.add_argument(
        "--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
        help="ZeroMQ address (bound) of the replay socket: a subscriber that missed batches asks "
        "it for every batch from a sequence number on, e.g. tcp://*:5558 (default: none)",
    )  # fmt: skip
    group.add_argument(
        "--kv-events-topic",
        default=None,
        metavar="TOPIC",
        help="the topic frame of every message; a subscriber filters on its prefix (default: "
        "empty)",
    )


def add_limit_options(parser) -> None:
    """The limits' options (limits.py: what each refuses, and why its default)."""
    from pagedlearn.__main__ import int_in, seconds

    group = parser.add_argument_group(
        "limits", "what one client may cost the server; a request over one is refused in "
        "OpenAI's error shape",
    )  # fmt: skip
    size = int_in(1)
    group.add_argument(
        "--max-body-bytes", type=size, default=MAX_BODY_BYTES, metavar="BYTES",
        help=f"largest request body, in bytes (default: {MAX_BODY_BYTES} = 16 MiB); larger: 413, "
        "before the body is read",
    )  # fmt: skip
    group.add_argument(
        "--max-header-bytes", type=size, default=MAX_HEADER_BYTES, metavar="BYTES",
        help=f"largest request line and headers, in bytes (default: {MAX_HEADER_BYTES} = 16 KiB, "
        "h11's); larger: 431",
    )  # fmt: skip
    group.add_argument(
        "--max-headers", type=size, default=MAX_HEADERS, metavar="N",
        help=f"most headers in a request (default: {MAX_HEADERS}); more: 431",
    )  # fmt: skip
    group.add_argument(
        "--header-timeout", type=seconds, default=HEADER_TIMEOUT, metavar="SECONDS",
        help=f"seconds a client has to send a request's headers (default: {HEADER_TIMEOUT:g}); "
        "later: 408 and the connection closed",
    )  # fmt: skip
    group.add_argument(
        "--body-timeout", type=seconds, default=BODY_TIMEOUT, metavar="SECONDS",
        help=f"seconds a client has to send a request's body, once its headers are in (default: "
        f"{BODY_TIMEOUT:g}); later: 408 and the connection closed",
    )  # fmt: skip
    group.add_argument(
        "--max-connections", type=size, default=None, metavar="N",
        help="most open connections (default: 1024, or fewer to stay below `ulimit -n`); past "
        "it, the oldest connection with no request in progress is closed, or the newcomer gets "
        "a 503",
    )  # fmt: skip


def cli(args) -> int:
    """``python -m pagedlearn serve``: serve until Ctrl-C or SIGTERM (``kill``; a background
    ``serve &`` of a non-interactive shell ignores Ctrl-C's SIGINT). Exit 2 for an option the
    model rules out (as the demo), 1 if it cannot start."""
    from urllib.parse import urlsplit

    from pagedlearn.cli.demo import OptionError
    from pagedlearn.serve.auth import listen_line, resolve_api_key

    try:
        api_key = resolve_api_key(args)  # $PAGEDLEARN_API_KEY empty or blank: ApiKeyError
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
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_headers=args.max_headers,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            max_connections=args.max_connections,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_events_replay_endpoint=args.kv_events_replay_endpoint,
            kv_events_topic=args.kv_events_topic or "",
        )
    except OptionError as e:  # a usage error, reported with serve's usage, as the demo does
        from pagedlearn.__main__ import build_parser

        build_parser()[1]["serve"].error(f"argument --{e.option.replace('_', '-')}: {e}")
    except PagedLearnError as e:
        print(f"serve stopped: {e}", file=sys.stderr)
        return 1
    key = "KEY" if args.api_key or args.api_key_file else "$PAGEDLEARN_API_KEY"
    auth = f' -H "Authorization: Bearer {key}"' if api_key else ""  # (never the key itself)
    body = f'{{"model": "{srv.model_name}", "prompt": "Hello, my name is", "max_tokens": 16}}'
    print(listen_line(args.host, urlsplit(srv.url).port, srv.model_name), flush=True)
    print(
        f"  try: curl {srv.base_url}/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'",
        flush=True,  # a log file or a pipe sees where it listens now, not at exit
    )
    if srv.kv_events is not None:
        pub = srv.kv_events
        replay = f" (replay: {pub.replay_endpoint})" if pub.replay_endpoint else ""
        print(f"  KV-cache events: {pub.endpoint}{replay}", flush=True)
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
