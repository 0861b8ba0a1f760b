"""Publish KV-cache events the way vLLM does, over ZeroMQ: pagedlearn's engine as a vLLM to routers.

**The transport** (vLLM's ``ZmqEventPublisher``, vllm/distributed/kv_events.py):

* a PUB socket sends each batch as a three-frame message ``(topic, seq, payload)``: the topic
  (bytes; ``""`` by default, a SUB socket filters on its prefix), the sequence number as 8 bytes
  big-endian (0, 1, 2, ... from the publisher's start) and the msgpack payload (messages.py).
  A PUB socket never waits for a subscriber: with nobody listening a batch is simply gone.
* **bind or connect**: an endpoint with a wildcard (``tcp://*:5557``, ``tcp://127.0.0.1:*`` for
  any free port), ``::`` or an ``ipc://`` / ``inproc://`` address is *bound* (the subscribers
  connect to it); any other (``tcp://router-host:5557``) is *connected to* (the subscriber, a
  router, binds). This is vLLM's rule; ``bind=`` overrides it.
* a replay ROUTER socket (optional, always bound) answers "every batch from sequence number N":
  a request is ``[b"", N as 8 bytes big-endian]`` (what a REQ socket sends; a DEALER sends the
  empty frame itself), the reply one message ``[b"", seq, payload]`` per batch still in the ring
  buffer with ``seq >= N``, in order, then the end marker ``[b"", (-1) as 8 signed bytes
  (ff ff ff ff ff ff ff ff), b""]``. The buffer keeps the last ``buffer_steps`` batches: when N
  is older than that, the reply starts at the oldest batch kept (the subscriber sees its first
  seq > N and knows the rest is lost); when N is past the newest, only the end marker comes.

**Threads.** ZeroMQ sockets are not thread-safe, so one thread of the publisher owns them: it
encodes, sends, buffers and answers replays. The engine's thread only puts a batch on a bounded
queue and never waits: when the queue is full (``max_queue`` batches: the network or the socket
thread fell behind) the batch is dropped and counted (``status()["dropped"]``), and a
subscriber sees a gap it can try to replay.

    with publish_kv_events(llm, "tcp://*:5557", "tcp://*:5558") as pub:
        llm.generate(prompts)      # every step that caches or evicts blocks sends a batch

:func:`publish_kv_events` wires it to an ``LLM`` or ``LLMEngine`` (``serve
--kv-events-endpoint`` calls it); the engine never imports this package.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events import check_positive_ints, import_extra
from pagedlearn.kv_events.block_hashes import HASH_FORMATS
from pagedlearn.kv_events.from_trace import TraceToEvents
from pagedlearn.kv_events.messages import KVEventBatch, encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
DEFAULT_ENDPOINT = "tcp://*:5557"  # vLLM's


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ``::`` or local-transport endpoint, connect to any other.

    >>> binds("tcp://*:5557"), binds("ipc:///tmp/kv"), binds("tcp://10.0.0.7:5557")
    (True, True, False)
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def socket_error(what: str, e: Exception) -> str:
    """Why a socket could not be opened, in words; a malformed address says what one looks like.

    >>> socket_error("the subscriber on foo", OSError("Invalid argument (addr='foo')"))
    "cannot open the subscriber on foo: Invalid argument (addr='foo'); an endpoint looks like \
tcp://HOST:PORT, tcp://*:PORT (bind every interface) or ipc:///PATH"
    """
    text = f"cannot open {what}: {e}"
    if "Invalid argument" in str(e) or "Protocol not supported" in str(e):
        text += "; an endpoint looks like tcp://HOST:PORT, tcp://*:PORT (bind every interface) or ipc:///PATH"
    return text


class KVEventPublisher:
    """A PUB socket (and optional replay ROUTER) sending :class:`KVEventBatch` es in vLLM's
    format, with its own thread. :meth:`publish` a batch yourself, or :meth:`attach` it to a
    KV-cache manager's trace. ``endpoint`` / ``replay_endpoint`` after binding to a wildcard
    port are the addresses actually bound."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        buffer_steps: int = 10_000,
        max_queue: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = 0,
        hash_format: str = "int",
        bind: bool | None = None,
        linger: float = 0.5,
    ) -> None:
        check_positive_ints(buffer_steps=buffer_steps, max_queue=max_queue, hwm=hwm)
        for name, value in (("endpoint", endpoint), ("topic", topic)):
            if not isinstance(value, str) or (name == "endpoint" and not value):
                raise KVEventsError(f"{name} must be a string, got {value!r}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise KVEventsError(f"replay_endpoint must be a string, got {replay_endpoint!r}")
        if hash_format not in HASH_FORMATS:
            raise KVEventsError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
        zmq = import_extra("zmq")
        self.topic, self.hash_format, self.data_parallel_rank = (
            topic,
            hash_format,
            data_parallel_rank,
        )
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # the replay ring
        self._linger_ms = int(linger * 1000)
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self.endpoint = open_endpoint(self._pub, endpoint, bind)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A ROUTER drops what is over its high-water mark: one whole replay must fit.
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 2)
                self.replay_endpoint = open_endpoint(self._replay, replay_endpoint, True)
        except zmq.ZMQError as e:
            self._close_sockets(0)
            raise KVEventsError(socket_error("the KV-event sockets", e)) from None
        self._counts = dict.fromkeys(
            (
                "accepted",
                "published",
                "dropped",
                "replay_requests",
                "bad_replay_requests",
                "errors",
            ),
            0,
        )
        self.last_error: str | None = None
        self._next_seq = 0
        self._detach: Any = None
        self._stop = threading.Event()
        self._closed = False
        # The sockets were made on this thread; from here on only the publisher thread uses
        # them (starting a thread is the memory barrier pyzmq asks for when a socket moves).
        self._thread = threading.Thread(target=self._run, name="pagedlearn-kv-events", daemon=True)
        self._thread.start()

    # --- the engine's side: never blocks ---------------------------------------------------------
    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch`` for sending; False (and counted in ``dropped``) if the queue is full."""
        if self._closed:
            raise KVEventsError("this KV-event publisher is closed")
        if not isinstance(batch, KVEventBatch):
            raise KVEventsError(f"publish needs a KVEventBatch, got {type(batch).__name__}")
        try:
            self._queue.put_nowait(batch)
            self._counts["accepted"] += 1
            return True
        except queue.Full:
            self._counts["dropped"] += 1
            return False

    def attach(self, kv) -> None:
        """Publish the block events of ``kv``, an engine's KV-cache manager (``engine.kv``:
        its ``trace``, ``block_size`` and, for a hybrid model's coordinator, its KV-cache
        ``groups``), from now on: one batch per engine step (from_trace.py says how each event
        translates). Blocks cached before the call were never announced: attach before
        serving."""
        if self._detach is not None:
            raise KVEventsError("this publisher is already attached to a trace")
        if self._closed:
            raise KVEventsError("this KV-event publisher is closed")
        listener = TraceToEvents(
            kv.block_size, self._from_trace, groups=getattr(kv, "groups", None),
            hash_format=self.hash_format, data_parallel_rank=self.data_parallel_rank,
        )  # fmt: skip
        self._detach = kv.trace.subscribe(listener)

    def _from_trace(self, batch: KVEventBatch) -> None:
        if not self._closed:
            self.publish(batch)

    def status(self) -> dict[str, Any]:
        """Counters: ``accepted`` (batches queued by :meth:`publish`), ``published`` (sent),
        ``dropped`` (not queued: the queue was full), ``queued`` (waiting now),
        ``buffered`` (kept for replay), ``next_seq``, ``replay_requests``,
        ``bad_replay_requests``, ``errors`` (sends that failed; ``last_error``)."""
        return {
            **self._counts, "queued": self._queue.qsize(), "buffered": len(self._buffer),
            "next_seq": self._next_seq, "last_error": self.last_error,
            "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
        }  # fmt: skip

    # --- the publisher's thread: owns the sockets ------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._serve_replays()
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            self._send(batch)
        deadline = time.monotonic() + self._linger_ms / 1000  # drain what the engine queued
        while time.monotonic() < deadline:
            try:
                self._send(self._queue.get_nowait())
            except queue.Empty:
                break
        self._close_sockets(self._linger_ms)

    def _send(self, batch: KVEventBatch) -> None:
        try:
            payload = encode_batch(batch)
            seq = self._next_seq
            self._pub.send_multipart((self.topic.encode(), seq.to_bytes(8, "big"), payload))
            self._next_seq += 1
            self._buffer.append((seq, payload))
            self._counts["published"] += 1
        except Exception as e:  # a send that fails must not end the thread: counted, kept
            self._counts["errors"] += 1
            self.last_error = f"{type(e).__name__}: {e}"

    def _serve_replays(self) -> None:
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            self._counts["replay_requests"] += 1
            # [identity, b"", seq] from a REQ or a DEALER that sends the empty frame (vLLM's
            # check); [identity, seq] from a bare DEALER: answered in the same envelope.
            envelope, start = frames[:-1], frames[-1]
            if len(frames) not in (2, 3) or len(start) != 8 or (len(frames) == 3 and frames[1]):
                self._counts["bad_replay_requests"] += 1
                if len(frames) in (2, 3):
                    replay.send_multipart((*envelope, END_SEQ, b""))  # nothing to replay
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((*envelope, END_SEQ, b""))

    def _close_sockets(self, linger_ms: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)  # at most linger_ms to flush what is in flight
        self._ctx.term()

    # --- the end ---------------------------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        """Stop listening to the trace, send what is queued (at most ``linger`` seconds), close
        the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._detach is not None:
            self._detach()
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._counts['published']} published"
        return f"KVEventPublisher({self.endpoint!r}, replay={self.replay_endpoint!r}, {state})"


def open_endpoint(sock, endpoint: str, bind: bool | None = None) -> str:
    """Bind or connect ``sock`` (``bind`` None: by :func:`binds`, vLLM's rule); returns the
    address (the real port of a wildcard one). The publisher's sockets and the subscriber's."""
    if binds(endpoint) if bind is None else bind:
        sock.bind(endpoint)
        return sock.getsockopt_string(import_extra("zmq").LAST_ENDPOINT)
    sock.connect(endpoint)
    return endpoint


def publish_kv_events(
    llm_or_engine, endpoint: str = DEFAULT_ENDPOINT, replay_endpoint: str | None = None, **kwargs
) -> KVEventPublisher:
    """A :class:`KVEventPublisher` (``kwargs``: its options) attached to the KV-cache manager of
    an ``LLM`` or ``LLMEngine``: from now on every engine step that stores or evicts cached
    blocks sends one batch. Close it (or use ``with``) to stop."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    kv = getattr(engine, "kv", None)
    if kv is None or not hasattr(kv, "trace"):
        raise KVEventsError(
            f"publish_kv_events needs an LLM or LLMEngine, got {type(llm_or_engine).__name__}"
        )
    publisher = KVEventPublisher(endpoint, replay_endpoint, **kwargs)
    try:
        publisher.attach(kv)
    except BaseException:
        publisher.close()
        raise
    return publisher
