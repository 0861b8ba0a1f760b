"""Follow a KV-cache event stream (vLLM's, or pagedlearn's own publisher.py) over ZeroMQ.

A SUB socket receives ``(topic, 8-byte big-endian seq, msgpack payload)`` messages; a
background thread owns it (ZeroMQ sockets are not thread-safe, and a notebook's kernel must
never wait on a socket), decodes each payload (messages.py) and hands ``(seq, batch)`` on, in
sequence order, through a bounded queue (:meth:`get`, :meth:`poll`, iteration) and callbacks
(``on_batch``, run on that thread: keep them short).

**Connect or bind.** vLLM *binds* a wildcard endpoint (``tcp://*:5557``: connect to
``tcp://HOST:5557``) and *connects* to any other (then the subscriber must bind the address the
server was given). The same rule decides here: an endpoint with ``*`` (or ``::``, ``ipc://``) is
bound, any other connected to; ``bind=`` overrides it.

**The stream is untrusted**, and each thing that can go wrong is counted in :meth:`status`:

* a gap in the sequence numbers (ZeroMQ drops messages when a queue is full, and a subscriber
  that connects late misses the start): with a ``replay_endpoint`` the subscriber asks for
  "every batch from N" (publisher.py's protocol; at most ``replay_timeout`` seconds) and delivers
  those in order; what the replay cannot fill (older than the publisher's buffer) is reported as
  a gap (``missed`` batches, and a line in ``problems``) and the stream goes on. At the start it
  asks for everything the publisher still holds (``catch_up``), and after ``replay_timeout``
  seconds without a message for anything newer than the last (a lost last batch shows no gap).
* a batch again (``duplicates``: a live copy of a batch already replayed counts here) or one
  older than the last (``out_of_order``) is dropped; a sequence that starts again at 0 is a
  restarted publisher (``restarts``) and is followed from there.
* a malformed message (not three frames, a bad payload, an unknown event type) is counted in
  ``malformed``, its error kept (the last ``keep_errors`` in ``problems``), and skipped.
* a publisher that vanishes: ``status()["state"]`` says ``"no batch for 12 s ..."`` once
  nothing came for ``silence_timeout`` seconds (vLLM sends nothing while idle, so an idle server
  and a dead one look the same: the message says both).
* a flood: at most ``max_queue`` batches (and ``max_queued_bytes`` of their payloads) wait for
  the reader; more are dropped (``dropped``). ZeroMQ itself holds at most ``rcvhwm`` messages of
  at most ``max_bytes`` (a bigger one disconnects its sender). Memory stays bounded by those:
  by default 256 x 4 MiB in ZeroMQ's queue and 256 MiB in ours, about 1.3 GiB at the very
  worst. A real batch is far smaller: one engine step's events, a few hundred bytes per block
  stored (a 32k-token prompt's ``BlockStored`` is about 117 KB).

``record=`` a path (or a recording.Recorder) saves every batch delivered (live or replayed, in
sequence order, malformed ones too), raw, with the time it came: recording.py reads it back.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events import check_positive_ints, import_extra
from pagedlearn.kv_events.messages import KVEventBatch, decode_batch
from pagedlearn.kv_events.publisher import END_SEQ, binds, open_endpoint, socket_error

Callback = Callable[[int, KVEventBatch], Any]
_COUNTERS = (
    "received", "decoded", "malformed", "duplicates", "out_of_order", "gaps", "missed",
    "replayed", "dropped", "restarts", "callback_errors",
)  # fmt: skip


class KVEventSubscriber:
    """Follows one publisher; ``with KVEventSubscriber("tcp://127.0.0.1:5557") as sub:``."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        bind: bool | None = None,
        on_batch: Callback | None = None,
        catch_up: bool = True,
        max_queue: int = 10_000,
        max_queued_bytes: int = 256 * 1024 * 1024,
        max_bytes: int = 4 * 1024 * 1024,  # (messages.MAX_PAYLOAD_BYTES: 16 MiB, decode's cap)
        rcvhwm: int = 256,
        replay_timeout: float = 1.0,
        silence_timeout: float = 10.0,
        keep_errors: int = 20,
        record=None,
    ) -> None:
        check_positive_ints(
            max_queue=max_queue, max_queued_bytes=max_queued_bytes, max_bytes=max_bytes,
            rcvhwm=rcvhwm, keep_errors=keep_errors,
        )  # fmt: skip
        for name, v in (("replay_timeout", replay_timeout), ("silence_timeout", silence_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise KVEventsError(f"{name} must be a positive number of seconds, got {v!r}")
        if not isinstance(endpoint, str) or not endpoint or not isinstance(topic, str):
            raise KVEventsError(f"endpoint and topic must be strings, got {endpoint!r}, {topic!r}")
        zmq = self._zmq = import_extra("zmq")
        self.topic, self.max_bytes = topic, max_bytes
        self.replay_timeout, self.silence_timeout, self.catch_up = (
            replay_timeout,
            silence_timeout,
            catch_up,
        )
        self._callbacks: list[Callback] = [on_batch] if on_batch is not None else []
        self._queue: deque[tuple[int, KVEventBatch, int]] = deque()
        self._limits = (max_queue, max_queued_bytes)
        self._queued_bytes = 0
        self._ready = threading.Condition()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._problems: deque[str] = deque(maxlen=keep_errors)  # the last errors and gaps, said
        self.last_seq: int | None = None
        self._seq0: bytes | None = None  # the digest of batch 0's payload
        self.last_message_time: float | None = None  # time.time() of the last message
        self._last_mono: float | None = None
        self._started = time.monotonic()
        self.replay_endpoint = replay_endpoint
        self._recorder = _recorder(record, endpoint, topic)
        self._ctx = zmq.Context()
        self._sub = self._dealer = None
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
            self._sub.setsockopt(zmq.MAXMSGSIZE, max_bytes + 4096)  # a bigger frame: disconnected
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self.bound = binds(endpoint) if bind is None else bool(bind)
            self.endpoint = open_endpoint(self._sub, endpoint, self.bound)
            self._dealer = self._new_dealer() if replay_endpoint is not None else None
        except zmq.ZMQError as e:
            self._close_sockets()
            raise KVEventsError(socket_error(f"the KV-event subscriber on {endpoint}", e)) from None
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedlearn-kv-sub", daemon=True)
        self._thread.start()  # from here on only that thread touches the sockets

    # --- the reader's side --------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)``; None if none came within ``timeout`` s (None: wait)."""
        with self._ready:
            if not self._queue and not self._closed:
                self._ready.wait(timeout)
            if not self._queue:
                return None
            seq, batch, n = self._queue.popleft()
            self._queued_bytes -= n
            return seq, batch

    def poll(self) -> list[tuple[int, KVEventBatch]]:
        """Every ``(seq, batch)`` waiting now, oldest first; never waits (for a notebook)."""
        with self._ready:
            out = [(s, b) for s, b, _ in self._queue]
            self._queue.clear()
            self._queued_bytes = 0
        return out

    def __iter__(self) -> Iterator[tuple[int, KVEventBatch]]:
        """``(seq, batch)`` as they come, until :meth:`close` (for a terminal, not a kernel)."""
        while not self._closed or self._queue:
            item = self.get(timeout=0.2)
            if item is not None:
                yield item

    def add_callback(self, fn: Callback) -> Callable[[], None]:
        """Call ``fn(seq, batch)`` on the subscriber's thread for every batch from now on;
        returns a function that removes it. An exception it raises is counted, not raised."""
        self._callbacks.append(fn)
        return lambda: fn in self._callbacks and self._callbacks.remove(fn)

    def status(self) -> dict[str, Any]:
        """The counters (module docstring), ``queued``, ``last_seq``, ``last_message_time``
        (epoch seconds), ``silent_for`` (seconds since the last message, or since the start),
        ``state`` (one line for a person), ``problems`` (the last errors and gaps)."""
        now = time.monotonic()
        silent = now - (self._last_mono if self._last_mono is not None else self._started)
        if self._closed:
            state = "closed"
        elif self._last_mono is None:
            state = f"waiting for the first batch ({silent:.0f} s)"
        elif silent > self.silence_timeout:
            state = f"no batch for {silent:.0f} s: the publisher is idle, or gone"
        else:
            state = f"live (last batch {silent:.1f} s ago)"
        return {
            **self._counts, "queued": len(self._queue), "last_seq": self.last_seq,
            "last_message_time": self.last_message_time, "silent_for": silent, "state": state,
            "problems": self.problems, "endpoint": self.endpoint, "bound": self.bound,
            "replay_endpoint": self.replay_endpoint,
        }  # fmt: skip

    # --- the subscriber's thread: owns the sockets ---------------------------------------------
    def _run(self) -> None:
        try:
            if self._dealer is not None and self.catch_up:
                self._replay(0, None)  # whatever the publisher still holds
            asked, idle = time.monotonic(), self.replay_timeout
            while not self._stop.is_set():
                if self._sub.poll(50):
                    self._on_message(self._sub.recv_multipart())
                    asked, idle = time.monotonic(), self.replay_timeout
                elif self._dealer is not None and time.monotonic() - asked > idle:
                    # Quiet for a while: ask for anything newer. A PUB socket drops what it
                    # sends before our subscription reaches it, and a lost *last* batch is
                    # never followed by one that shows the gap: only asking finds them. Less
                    # and less often (up to once a minute) while nothing comes.
                    self._replay(0 if self.last_seq is None else self.last_seq + 1, None)
                    asked, idle = time.monotonic(), min(2 * idle, 60.0)
        except Exception as e:  # a bug here must not pass silently: said in the status
            self._problem(f"the subscriber thread stopped: {type(e).__name__}: {e}")
        finally:
            self._close_sockets()

    def _on_message(self, frames: list[bytes]) -> None:
        self._counts["received"] += 1
        self.last_message_time, self._last_mono = time.time(), time.monotonic()
        if len(frames) != 3 or len(frames[1]) != 8:
            sizes = ", ".join(str(len(f)) for f in frames[:4])
            return self._malformed(f"a message is 3 frames (topic, 8-byte seq, payload); got "
                                   f"{len(frames)} of {sizes} bytes")  # fmt: skip
        seq, last = int.from_bytes(frames[1], "big"), self.last_seq
        if last is not None and seq == 0 and last > 0 and _digest(frames[2]) != self._seq0:
            # A new publisher (the same one's seq 0 again is a live copy of a replayed batch).
            self._counts["restarts"] += 1
            self._problem(f"the publisher restarted (seq went from {last} back to 0)")
            last = self.last_seq = None
        if last is not None and seq <= last:
            self._counts["duplicates" if seq == last else "out_of_order"] += 1
            return
        expected = 0 if last is None else last + 1
        if seq > expected and (last is not None or self._dealer is not None):
            self._counts["gaps"] += 1
            self._replay(expected, seq)  # a gap: fill it if the publisher still can
        if self.last_seq is not None and seq <= self.last_seq:
            self._counts["duplicates"] += 1  # (the replay delivered it already)
            return
        self._deliver(seq, frames[2], replayed=False)

    def _replay(self, first: int, upto: int | None) -> None:
        """Ask for every batch from ``first``; deliver those below ``upto`` (all if None)."""
        if self._dealer is not None:
            self._dealer.send_multipart((b"", first.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout
            while (wait := deadline - time.monotonic()) > 0 and self._dealer.poll(wait * 1000):
                frames = self._dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == END_SEQ:
                    break  # the end marker (or a reply we cannot read: the same)
                seq = int.from_bytes(frames[1], "big")
                if (upto is None or seq < upto) and (self.last_seq is None or seq > self.last_seq):
                    self._note_lost(seq)
                    self._deliver(seq, frames[2], replayed=True)
            else:  # no end marker in time: a stale answer must not end the next replay early
                self._problem(f"the replay socket did not answer in {self.replay_timeout} s")
                self._dealer.close(linger=0)
                self._dealer = self._new_dealer()
        if upto is not None:
            self._note_lost(upto)

    def _note_lost(self, seq: int) -> None:
        """Batches between the last delivered one and ``seq`` are lost: say so."""
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq > expected and (self.last_seq is not None or self._dealer is not None):
            self._counts["missed"] += seq - expected
            why = "not in the replay buffer" if self._dealer is not None else "no replay endpoint"
            self._problem(f"batches {expected}..{seq - 1} lost ({why})")
            self.last_seq = seq - 1

    def _deliver(self, seq: int, payload: bytes, replayed: bool) -> None:
        self.last_message_time, self._last_mono = time.time(), time.monotonic()
        if self._recorder is not None:
            self._recorder.write(seq, payload)
        if seq == 0:
            self._seq0 = _digest(payload)  # to tell a restarted publisher from a copy of seq 0
        self._counts["replayed"] += replayed
        try:
            self._decode_and_queue(seq, payload)
        finally:  # set last: a reader who sees last_seq == seq finds the batch already queued
            self.last_seq = seq  # even if it did not decode: asking again would not help

    def _decode_and_queue(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload, max_bytes=self.max_bytes)
        except KVEventsError as e:
            return self._malformed(f"batch {seq}: {e}")
        self._counts["decoded"] += 1
        for fn in tuple(self._callbacks):
            try:
                fn(seq, batch)
            except Exception as e:
                self._counts["callback_errors"] += 1
                self._problem(f"callback {fn!r} raised at batch {seq}: {e!r}")
        with self._ready:
            max_queue, max_bytes = self._limits
            if len(self._queue) >= max_queue or self._queued_bytes + len(payload) > max_bytes:
                self._counts["dropped"] += 1  # the reader is slower than the stream
                return
            self._queue.append((seq, batch, len(payload)))
            self._queued_bytes += len(payload)
            self._ready.notify_all()

    def _malformed(self, why: str) -> None:
        self._counts["malformed"] += 1
        self._problem(why)

    def _problem(self, line: str) -> None:
        with self._ready:  # status() reads them from another thread
            if not self._problems or self._problems[-1] != line:  # (a silent replay socket)
                self._problems.append(line)

    @property
    def problems(self) -> list[str]:
        """The last ``keep_errors`` errors and gaps, oldest first, one line each."""
        with self._ready:
            return list(self._problems)

    def _new_dealer(self):
        dealer = self._ctx.socket(self._zmq.DEALER)
        dealer.setsockopt(self._zmq.MAXMSGSIZE, self.max_bytes + 4096)
        dealer.connect(self.replay_endpoint)  # the publisher binds its replay socket
        return dealer

    def _close_sockets(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)  # a subscriber sends nothing worth waiting for
        self._ctx.term()
        if self._recorder is not None:
            self._recorder.close()

    # --- the end -------------------------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the sockets (and the recording). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)
        with self._ready:
            self._ready.notify_all()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVEventSubscriber({self.endpoint!r}, last_seq={self.last_seq})"


def _recorder(record, endpoint: str, topic: str):
    """``record``: None, a path (a new recording.Recorder), or something with write / close."""
    if record is None or hasattr(record, "write"):
        return record
    from pagedlearn.kv_events.recording import Recorder

    return Recorder(record, endpoint=endpoint, topic=topic)


def _digest(payload: bytes) -> bytes:
    """SHA-256 of a payload: a sender cannot make two differ and match, as it could with the
    built-in ``hash()`` (core/prefix_cache.py says why the package never uses that)."""
    return hashlib.sha256(payload).digest()
