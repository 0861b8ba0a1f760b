"""``python -m pagedlearn kv-events``: watch a server's prefix cache through its KV-event stream.

Two sources, one picture (kv_events/cache_state.py):

- ``--endpoint tcp://HOST:5557`` follows a live stream (vLLM's ``--kv-events-config``, or
  ``pagedlearn serve --kv-events-endpoint``) and refreshes a summary in the terminal: what the
  subscriber received (gaps, malformed batches, replays), the blocks cached per medium, the
  cache's shape and its most shared prefixes. ``--record FILE`` saves the stream as it comes;
  ``--duration S`` stops after S seconds; Ctrl-C stops, and the final summary is printed.
- ``--from FILE`` reads such a recording, with no server, and prints the same summary.

Either way ``--png FILE`` draws the prefix tree (``--timeline-png`` the timeline) at the end, and
``--tokens`` (or ``--prompt`` with ``--tokenizer``) says how much of a new prompt is cached now:
by its tokens, and, with ``--hash-algo`` (and vLLM's ``--python-hash-seed``), by its hashes --
both of which the stream does not carry (block_hashes.py says what is unknowable, and why).

Exit codes as the other commands: 0 done, 1 a recording or a socket that cannot be used, 2 a bad
option or the ``[kv-events]`` extra missing (one line each).
"""

from __future__ import annotations

import itertools
import shutil
import sys
import time
from pathlib import Path

LIVE_ONLY = ("replay_endpoint", "topic", "record", "duration", "bind")


def add_arguments(p) -> None:
    """The command's options (``python -m pagedlearn kv-events --help``)."""
    from pagedlearn.__main__ import int_in, seconds
    from pagedlearn.kv_events.block_hashes import ALGORITHMS
    from pagedlearn.kv_events.cache_state import MAX_BLOCKS

    src = p.add_argument_group("source (one of)")
    src.add_argument(
        "--endpoint",
        metavar="ENDPOINT",
        help="the publisher's ZeroMQ address, "
        "e.g. tcp://127.0.0.1:5557 (vLLM binds tcp://*:5557: connect to its host)",
    )
    src.add_argument(
        "--from",
        dest="from_file",
        metavar="RECORDING",
        help="read a recording (made with --record) instead of a live stream: no server needed",
    )
    live = p.add_argument_group("live stream")
    live.add_argument(
        "--replay-endpoint",
        metavar="ENDPOINT",
        help="the publisher's replay "
        "socket: batches missed (a gap, a late start) are asked for again",
    )
    live.add_argument("--topic", help="the topic to subscribe to (default: all)")
    live.add_argument(
        "--bind",
        action="store_true",
        default=None,
        help="bind ENDPOINT instead "
        "of connecting (for a server given a non-wildcard address, which connects; "
        "default: vLLM's rule, bind only a wildcard / ipc address)",
    )
    live.add_argument("--record", metavar="FILE", help="save every batch received (JSON lines)")
    live.add_argument(
        "--duration",
        type=seconds,
        metavar="SECONDS",
        help="stop after this many seconds (default: at Ctrl-C)",
    )
    live.add_argument(
        "--interval", type=seconds, metavar="SECONDS", default=1.0, help="seconds between refreshes"
    )
    out = p.add_argument_group("output")
    out.add_argument("--png", metavar="FILE", help="draw the prefix tree there at the end")
    out.add_argument("--timeline-png", metavar="FILE", help="draw the timeline there at the end")
    out.add_argument("--color-by", choices=("age", "medium"), default="age", help="tree colours")
    out.add_argument("--top", type=int_in(0), metavar="N", default=5, help="shared prefixes listed")
    out.add_argument(
        "--max-blocks",
        metavar="N",
        type=int_in(1),
        default=MAX_BLOCKS,
        help="blocks held at most (memory: about 0.85 KB each with 16 tokens); past it the "
        "picture says it is incomplete",
    )
    hit = p.add_argument_group("a new prompt: how much of it is cached now")
    hit.add_argument("--tokens", metavar="IDS", help="its token ids, e.g. 1,2,3 (or '1 2 3')")
    hit.add_argument("--prompt", metavar="TEXT", help="its text (needs --tokenizer)")
    hit.add_argument(
        "--tokenizer",
        metavar="NAME",
        help="a Hugging Face tokenizer (name or path), or pagedlearn/byte (the offline models' "
        "byte tokenizer): encodes --prompt, decodes the prefixes shown",
    )
    hit.add_argument(
        "--hash-algo",
        choices=(*ALGORITHMS, "pagedlearn"),  # vLLM's, and pagedlearn serve's own
        help="also match by hash, computed as "
        "the server does (its --prefix-caching-hash-algo; 'pagedlearn' for "
        "pagedlearn serve). Not in the stream: you must know it",
    )
    hit.add_argument(
        "--python-hash-seed",
        metavar="TEXT",
        help="the vLLM server's "
        "PYTHONHASHSEED (without it vLLM's root hash is random: no match by hash)",
    )
    hit.add_argument("--model-id", metavar="ID", help="with --hash-algo pagedlearn: the served "
                     "model's id (its name), which is in every pagedlearn block hash")  # fmt: skip


def check(args, own) -> None:
    """Usage errors, before anything runs: ``own.error`` (exit 2) naming the option."""
    from pagedlearn.__main__ import writable_dir

    if (args.endpoint is None) == (args.from_file is None):
        own.error("give --endpoint ENDPOINT (a live stream) or --from RECORDING, one of them")
    if args.from_file is not None:
        for name in LIVE_ONLY:
            if getattr(args, name) is not None:
                own.error(f"argument --{name.replace('_', '-')}: only with --endpoint")
        if not Path(args.from_file).is_file():
            own.error(f"argument --from: {args.from_file} is not a file")
    for option in ("record", "png", "timeline_png"):
        path = getattr(args, option)
        if path is not None:
            flag = f"--{option.replace('_', '-')}"
            if Path(path).is_dir():
                own.error(f"argument {flag}: {path} is a directory; give a file name")
            why = writable_dir(Path(path).parent)
            if why:
                own.error(f"argument {flag}: {why}")
    if args.prompt is not None and (args.tokens is not None or args.tokenizer is None):
        own.error("argument --prompt: needs --tokenizer, and not --tokens")
    if args.tokens is not None:
        try:
            args.token_ids = [int(t) for t in args.tokens.replace(",", " ").split()]
        except ValueError:
            own.error(f"argument --tokens: token ids are integers, got {args.tokens!r}")
    if args.hash_algo is not None and args.tokens is None and args.prompt is None:
        own.error("argument --hash-algo: only with --tokens or --prompt (the prompt to hash)")
    vllm = args.hash_algo not in (None, "pagedlearn")
    if vllm and args.python_hash_seed is None:
        own.error(
            "argument --hash-algo: vLLM's root hash (NONE_HASH) is random unless the "
            "server ran with PYTHONHASHSEED set; give --python-hash-seed (its value)"
        )
    if args.python_hash_seed is not None and not vllm:
        own.error("argument --python-hash-seed: only with a vLLM --hash-algo")
    if args.model_id is not None and args.hash_algo != "pagedlearn":
        own.error("argument --model-id: only with --hash-algo pagedlearn")  # fmt: skip


def cli(args, own) -> int:
    from pagedlearn.errors import KVEventsError
    from pagedlearn.kv_events import import_extra

    check(args, own)
    try:  # the [kv-events] extra: msgspec decodes, pyzmq only for a live stream
        for name in ("msgspec", "zmq") if args.endpoint else ("msgspec",):
            import_extra(name)
    except KVEventsError as e:
        print(f"kv-events: {e}", file=sys.stderr)
        return 2
    from pagedlearn.kv_events.cache_state import KVCacheState

    state = KVCacheState(max_blocks=args.max_blocks)
    try:
        tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
        if args.from_file is not None:
            _read(args, state, tokenizer)
        else:
            _follow(args, state, tokenizer)
        _finish(args, state, tokenizer)
    except KVEventsError as e:
        print(f"kv-events stopped: {e}", file=sys.stderr)
        return 1
    return 0


def _tokenizer(name: str):
    from pagedlearn.errors import KVEventsError
    from pagedlearn.models.tokenizer import ByteTokenizer

    if name == ByteTokenizer.name_or_path:  # pagedlearn's offline models' (tiny-gpt2, ...)
        return ByteTokenizer()
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # not cached and no network, a bad name: one line, not a traceback
        raise KVEventsError(
            f"cannot load the tokenizer {name!r}: {str(e).splitlines()[0]}"
        ) from None


def _read(args, state, tokenizer) -> None:
    from pagedlearn.kv_events.recording import read_recording

    rec = read_recording(args.from_file)
    state.extend(rec.batches())
    seqs = [r.seq for r in rec.records]
    lost = sum(b - a - 1 for a, b in itertools.pairwise(seqs))
    print(f"recording {args.from_file}: {len(rec)} batches from {rec.header.get('endpoint') or '?'}"
          f", {len(rec.errors)} malformed, {lost} missing from the sequence")  # fmt: skip
    for line in rec.errors[-3:]:
        print(f"  {line}")


def _follow(args, state, tokenizer) -> None:
    from pagedlearn.kv_events.subscriber import KVEventSubscriber

    sub = KVEventSubscriber(args.endpoint, args.replay_endpoint, args.topic or "", bind=args.bind,
                            record=args.record)  # fmt: skip
    how = "bound" if sub.bound else "connected"
    print(f"kv-events: following {sub.endpoint} ({how}); Ctrl-C to stop", flush=True)
    tty, shown = sys.stdout.isatty(), 0
    end = time.monotonic() + args.duration if args.duration else None
    last = time.monotonic()
    try:
        while end is None or time.monotonic() < end:
            wait = (
                args.interval
                if end is None
                else max(0.0, min(args.interval, end - time.monotonic()))
            )
            item = sub.get(timeout=wait)
            if item is not None:
                state.apply(item)
                state.extend(sub.poll())
            if time.monotonic() - last >= args.interval:
                lines = live_lines(sub.status(), state, tokenizer, args.top)
                if tty:  # rewrite the block in place: up to its first line, clear to the end
                    cols = shutil.get_terminal_size().columns - 1  # (a wrapped line: miscounted)
                    up = f"\x1b[{shown}F\x1b[J" if shown else ""
                    sys.stdout.write(up + "\n".join(line[:cols] for line in lines) + "\n")
                else:
                    sys.stdout.write(lines[0] + " | " + lines[2] + "\n")  # state | cached now
                sys.stdout.flush()
                shown, last = len(lines), time.monotonic()
        if tty and shown:  # the final summary takes the live block's place
            sys.stdout.write(f"\x1b[{shown}F\x1b[J")
    except KeyboardInterrupt:
        print("\nstopped (Ctrl-C)")
    finally:
        sub.close()
        state.extend(sub.poll())  # what came before the close
    print(live_lines(sub.status(), state, tokenizer, 0)[0])


def live_lines(status: dict, state, tokenizer, top: int) -> list[str]:
    """The refreshing block: the subscriber's state and counters, then the cache's summary."""
    keys = ("received", "malformed", "gaps", "missed", "replayed", "dropped", "duplicates")
    counts = " · ".join(f"{k} {status.get(k, 0)}" for k in keys)
    summary = state.summary(top=top).lines(tokenizer, hashes_note=False)
    return [f"{status.get('state', '')}: {counts}", *summary]


def _finish(args, state, tokenizer) -> None:
    print("\n".join(state.summary(top=args.top).lines(tokenizer)))
    ids = getattr(args, "token_ids", None)
    if args.prompt is not None:
        ids = tokenizer.encode(args.prompt)
    if ids is not None and state.block_sizes:
        print("\n".join(state.hit_opportunities(ids, _hasher(args, state)).lines()))
    elif ids is not None:
        print("prompt: no block cached yet, nothing to match")
    if args.png:
        from pagedlearn.viz.prefix_tree import draw_prefix_tree

        draw_prefix_tree(state, color_by=args.color_by, tokenizer=tokenizer).savefig(args.png)
        print(f"wrote the prefix tree to {args.png}")
    if args.timeline_png and state.timeline:
        from pagedlearn.viz.kv_events_timeline import draw_kv_events_timeline

        draw_kv_events_timeline(state).savefig(args.timeline_png)
        print(f"wrote the timeline to {args.timeline_png}")


def _hasher(args, state):
    if args.hash_algo is None:
        return None
    from pagedlearn.errors import KVEventsError
    from pagedlearn.kv_events.block_hashes import BlockHashError, make_hasher

    size = state.block_size  # the stream's own
    options = ({"model_id": args.model_id} if args.hash_algo == "pagedlearn"
               else {"python_hash_seed": args.python_hash_seed})  # fmt: skip
    try:
        return make_hasher(args.hash_algo, size, **options)
    except BlockHashError as e:  # xxhash not installed, say
        raise KVEventsError(str(e)) from None
