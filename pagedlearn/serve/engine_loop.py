"""The engine loop: one thread owns the ``LLMEngine``; the HTTP handlers talk to it by message.

An ``LLMEngine`` is not thread-safe (nothing in it locks), and it must not be: a step reads and
writes the scheduler's queues, the block pool and every request. A server has many clients at
once, so it does what vLLM does -- one loop, the engine core's *busy loop*
(``EngineCoreProc.run_busy_loop`` in vLLM's ``v1/engine/core.py``), is the only code that touches
the engine, and everything else sends it messages::

    HTTP handlers (asyncio, uvicorn's thread)            engine thread (EngineLoop._run)
    ───────────────────────────────────────             ──────────────────────────────────
    await loop.add_request(...) ──── add ────> queue ──> drain commands: add / abort / call
    stream.cancel() (client gone) ── abort ──>   │       step() while there is work
    await loop.call(fn) ──────────── call ───>   │       block on the queue when idle
                                                 │            │
    async for out in stream <── call_soon_threadsafe ─── outputs, grouped per event loop

vLLM v1 splits the same two halves across processes (``AsyncLLM`` is the asyncio front,
``EngineCore`` runs the busy loop); here they are two threads of one process, and the queue is a
``queue.SimpleQueue`` instead of a ZeroMQ socket.

Rules worth knowing:

- Outputs are cumulative (a ``RequestOutput`` holds every token so far), so a stream keeps only
  the newest one (streams.py): a slow reader gets several tokens at once, never loses one.
- ``add_request`` answers only once the engine has taken (or refused) the request: a
  ``RequestRejectedError`` reaches the caller before any output, so a server can still answer
  with a 400. A stream whose reader stops early -- ``cancel()``, or the ``generate`` iterator
  closed or cancelled because the client went away -- aborts its request on the engine thread at
  once, and its blocks go back to the pool.
- A step that raises does not stop the loop: the engine rolls itself back (recovery.py), the loop
  logs it and goes on, and the requests recovery gave up on get their outputs with finish reason
  "error". An engine whose pool is broken (``engine.broken``) fails every stream and refuses new
  requests (:class:`EngineDeadError`; the server answers 503).
- Nothing is kept per request once it finishes, and nothing per step: a server runs for days.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from pagedlearn.engine.request import RequestOutput
from pagedlearn.errors import PagedLearnError
from pagedlearn.serve.streams import RequestStream

__all__ = ["EngineDeadError", "EngineLoop", "RequestLostError", "RequestStream"]
logger = logging.getLogger(__name__)


class EngineDeadError(PagedLearnError, RuntimeError):
    """The engine loop takes no more work: it was stopped, or the engine is broken."""


class RequestLostError(PagedLearnError, RuntimeError):
    """The engine dropped a request without handing out its final output: something aborted it
    through :meth:`EngineLoop.call` (``engine.abort_request`` returns that output to its
    caller, not to the stream)."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: object
    cache_salt: str | None
    final_only: bool
    stream: RequestStream
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable
    done: concurrent.futures.Future


_STOP = object()


class EngineLoop:
    """Runs ``engine`` on a daemon thread of its own; the only code that touches it.

    >>> from pagedlearn import LLM
    >>> loop = EngineLoop(LLM("tiny-gpt2", num_blocks=8, verbose=False).engine).start()
    >>> loop.call(lambda engine: engine.kv.allocator.num_blocks).result(timeout=10)
    8
    >>> loop.stop()
    """

    def __init__(self, engine, name: str = "pagedlearn-engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched only on the engine thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped: str | None = None  # why it takes no more work
        self._lock = threading.Lock()  # a command is queued before the loop stops, or refused

    # --- any thread ---------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request, fail their streams, and end the thread (idempotent)."""
        if self._thread.is_alive():
            self._send(_STOP)
            self._thread.join(timeout)
        with self._lock:  # (a thread stuck in a step past the timeout: refuse work anyway)
            self._stopped = self._stopped or "the server is shutting down"

    @property
    def error(self) -> str | None:
        """Why the loop takes no work (stopped, or the engine is broken), or None."""
        if self.engine.broken:
            return f"the engine is broken: {self.engine.broken}"
        if self._stopped or not self._thread.is_alive():
            return self._stopped or "the engine loop is not running"
        return None

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps; a Future of its result (in
        asyncio: ``await asyncio.wrap_future(loop.call(fn))``). Use it for anything that reads
        or changes live state: metrics, ``abort_request``, tests' checks."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, done), done)
        return done

    def _send(self, command, done: concurrent.futures.Future | None = None) -> None:
        with self._lock:
            if not self._stopped:
                self._commands.put(command)
                return
        if done is not None:
            done.set_exception(EngineDeadError(self._stopped))

    # --- the event loop's side ----------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params,
        cache_salt: str | None = None,
        stream: bool = True,
    ) -> RequestStream:
        """Queue a request on the engine; returns its :class:`RequestStream` once the engine
        took it. Raises what ``LLMEngine.add_request`` raised (``RequestRejectedError``), or
        :class:`EngineDeadError`. ``stream=False``: the stream gets the final output only."""
        s = RequestStream(str(request_id), on_cancel=lambda rid: self._send(_Abort(rid)))
        done: concurrent.futures.Future = concurrent.futures.Future()
        ids = list(prompt_token_ids)
        self._send(_Add(s.request_id, ids, params, cache_salt, not stream, s, done), done)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the caller left while the engine was adding it
            s.cancel()
            raise
        return s

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params,
        cache_salt: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's ``AsyncLLM.generate``: ``async for out in loop.generate(...)``. Errors of
        :meth:`add_request` come before the first output; leaving the loop early (``break``,
        a cancelled task) aborts the request."""
        s = await self.add_request(request_id, prompt_token_ids, params, cache_salt, stream)
        try:
            async for out in s:
                yield out
        finally:
            s.cancel()

    # --- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Idle: sleep on the queue until a command comes (no busy-wait). Busy: take
                # what has come, without waiting, and step.
                busy = self.engine.has_unfinished_requests() and not self.engine.broken
                command = self._commands.get() if not busy else _get_nowait(self._commands)
                while command is not None:
                    if command is _STOP:
                        self._shut_down("the server is shutting down")
                        return
                    self._do(command)
                    command = _get_nowait(self._commands)
                if self.engine.has_unfinished_requests() and not self.engine.broken:
                    self._step()
        except BaseException as exc:  # a bug here: say so to every reader, never hang them
            logger.exception("pagedlearn: the engine loop stopped")
            self._shut_down(f"the engine loop stopped: {exc!r}")

    def _do(self, command) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                try:
                    self.engine.abort_request(command.request_id)  # its blocks: back now
                except Exception:  # only a broken engine raises here; _step says so
                    logger.exception("pagedlearn: aborting %r failed", command.request_id)
        else:
            _run_into(command.done, command.fn, self.engine)
            if self.engine.broken:
                self._fail_all(EngineDeadError(f"the engine is broken: {self.engine.broken}"))
            elif not self.engine.has_unfinished_requests():  # (else: the next step sweeps)
                self._sweep()

    def _add(self, c: _Add) -> None:
        if not c.done.set_running_or_notify_cancel():
            return
        if self.engine.broken:
            c.done.set_exception(EngineDeadError(f"the engine is broken: {self.engine.broken}"))
            return
        try:
            self.engine.add_request(
                c.request_id, c.prompt_token_ids, c.params,
                cache_salt=c.cache_salt, final_only=c.final_only,
            )  # fmt: skip
        except Exception as e:  # RequestRejectedError, mostly: the caller answers 400
            c.done.set_exception(e)
            return
        self._streams[c.request_id] = c.stream
        c.done.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the engine rolled itself back (recovery.py); go on
            # (its requests re-queued; those it gave up on come out of the next step)
            logger.warning("pagedlearn: a step raised %r; %s", exc, getattr(exc, "__notes__", ""))
        else:
            self._deliver(outputs)
            self._sweep()
        if self.engine.broken:  # it failed every request it had; refuse new ones
            self._fail_all(EngineDeadError(f"the engine is broken: {self.engine.broken}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its stream (a finished request's stream is let go)."""
        items = []
        for out in outputs:
            s = self._streams.pop(out.request_id) if out.finished else None
            s = s or self._streams.get(out.request_id)
            if s is not None:  # (requests added by srv.call have no stream)
                items.append((s, s.put, out))
        _hand_out(items)

    def _sweep(self) -> None:
        """Fail the streams whose request the engine no longer has. Run where the engine holds
        no undelivered output (after a step that returned, or when it has no work): then a
        request that is gone was aborted by a call, and its stream would wait forever."""
        lost = [rid for rid in self._streams if rid not in self.engine.requests]
        for rid in lost:
            s = self._streams.pop(rid)
            error = RequestLostError(f"request {rid!r} was aborted on the engine thread (a call)")
            _hand_out([(s, s.fail, error)])

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        _hand_out([(s, s.fail, error) for s in streams])

    def _shut_down(self, why: str) -> None:
        with self._lock:  # from now on _send refuses: what is queued is all there will be
            self._stopped = why
        for rid in list(self._streams):
            with contextlib.suppress(Exception):  # a broken engine: the streams fail anyway
                self.engine.abort_request(rid)
        self._fail_all(EngineDeadError(why))
        while (command := _get_nowait(self._commands)) is not None:  # answer what is left
            done = getattr(command, "done", None)
            if done is not None and done.set_running_or_notify_cancel():
                done.set_exception(EngineDeadError(why))


def _get_nowait(q: queue.SimpleQueue):
    try:
        return q.get_nowait()
    except queue.Empty:
        return None


def _run_into(done: concurrent.futures.Future, fn: Callable, *args) -> None:
    if not done.set_running_or_notify_cancel():
        return
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # the caller's function: its error is the caller's
        done.set_exception(e)


def _hand_out(items: list[tuple[RequestStream, Callable, object]]) -> None:
    """Run each ``fn(arg)`` on its stream's event loop: one ``call_soon_threadsafe`` per loop
    (each wakes the loop up), not one per stream."""
    batches: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, fn, arg in items:
        batches.setdefault(stream.loop, []).append((fn, arg))
    for loop, calls in batches.items():

        def run(calls=calls) -> None:
            for fn, arg in calls:
                fn(arg)

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads these streams
            loop.call_soon_threadsafe(run)
