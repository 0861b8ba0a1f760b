"""Errors raised by pagedlearn.

Every error the package raises on purpose is a :class:`PagedLearnError`, so a lab can catch them all
with one ``except``. Running out of physical blocks is the one failure a serving engine expects and
handles (by waiting, preempting or rejecting), so it has its own class.

Messages say what was asked for and what was available, e.g. ``need 3 blocks, 1 free of 64``.
Whenever one of these is raised, the state it was raised from is unchanged: nothing half-allocated.

One exception is not ours to raise: a ``KeyboardInterrupt`` (Ctrl-C) can land between any two
bytecodes. Where that would leave state half changed -- the engine's bookkeeping
(engine/recovery.py), a message half written to a worker's pipe or half read from it
(parallel/executor.py) -- the work runs inside :func:`held_interrupts`: Ctrl-C is noted, the work
finishes, then the interrupt is raised.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class PagedLearnError(Exception):
    """Base class: a request the memory manager cannot carry out (bad id, double free, ...)."""


class OutOfBlocksError(PagedLearnError):
    """The pool has fewer free blocks than an operation needs.

    Attributes ``needed``, ``free`` and ``total`` let a scheduler decide what to do next.
    """

    def __init__(self, needed: int, free: int, total: int, what: str = "") -> None:
        self.needed, self.free, self.total = needed, free, total
        msg = f"need {needed} block{'s' if needed != 1 else ''}, {free} free of {total}"
        super().__init__(f"{what}: {msg}" if what else msg)


class AttentionInputError(PagedLearnError, ValueError):
    """An attention reference or kernel was handed tensors it cannot use: a wrong rank, dtype or
    device, heads that do not divide, a block table that points outside the cache, ...

    It is also a ``ValueError``, so ``except ValueError`` catches it as well. The message names the
    argument. It is raised before anything is launched or written.
    """


class KernelUnavailableError(PagedLearnError, RuntimeError):
    """A Triton kernel cannot run here: Triton is not installed, or the tensors are on the CPU and
    Triton's interpreter is off. The message says what to do (set ``TRITON_INTERPRET=1``, or use
    the PyTorch reference in :mod:`pagedlearn.attention`).
    """


class TraceFileError(PagedLearnError, ValueError):
    """A recorded trace that cannot be replayed: a JSON file (``EventLog.to_json``) that is not
    JSON, has a field of the wrong type, a block id outside the pool, frees a sequence that was
    never added, or is larger than the caps of :mod:`pagedlearn.trace.limits` -- or such an event
    handed to a replay in memory (``PoolReplay.apply``).

    The message names the first bad event (its index and kind) and what is wrong with it, e.g.
    ``event 7 (free): frees sequence 'b', which is not in the pool (...)``. A replay that raises
    it has not applied that event. It is also a ``ValueError``, as a replay's errors were before.
    """


class KVEventsError(PagedLearnError, ValueError):
    """A KV-cache event stream (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
    over ZeroMQ, pagedlearn/kv_events/) that cannot be used: a payload that is not msgpack, an
    event type we do not know (named), a field of the wrong type (with its path), a message over
    the size caps of kv_events/messages.py, a recording that is not one; or a socket that
    cannot be opened, or the ``[kv-events]`` extra (pyzmq, msgspec) not installed. A stream is
    untrusted input: a subscriber counts these and carries on."""


def add_note(exc: BaseException, text: str) -> None:
    """Attach ``text`` to ``exc`` (PEP 678): the traceback prints it under the error. Python
    3.10 has no ``add_note``; there the note still goes in ``exc.__notes__``, where code and
    tests can read it (the traceback does not print it)."""
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(text)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), text]


class ModelLoadError(PagedLearnError, OSError):
    """A model could not be loaded: not cached and no network, an unknown name, not a causal LM,
    a bad ``dtype``, ... Also an ``OSError``, as the errors of ``from_pretrained`` are.
    (``pagedlearn.models.ModelLoadError`` is this class.)"""


class WorkerError(PagedLearnError, RuntimeError):
    """A tensor-parallel worker (pagedlearn/parallel/) died, raised, or did not answer in time.

    The workers' process group cannot be trusted after that, so every worker is stopped, the
    requests in flight fail, and the engine refuses more work (``engine.broken``): build a new
    ``LLM``. The message names the worker (rank and pid) and what happened to it."""


# --- Ctrl-C held while a piece of work must finish whole -----------------------------------------
try:  # the C functions behind signal.signal / getsignal, without their enum conversions (which
    import _signal as _sig  # raise and catch a ValueError per call); CPython's private module
except ImportError:  # not CPython
    _sig = signal

_SIGINT = int(signal.SIGINT)


@contextlib.contextmanager
def held_interrupts(reraise: bool = True):
    """Hold Ctrl-C (SIGINT) until the block ends, then raise ``KeyboardInterrupt`` (if
    ``reraise``). A second Ctrl-C raises at once. Only in the main thread with Python's default
    handler (a script, a Jupyter cell); elsewhere, or when already held, it does nothing."""
    main = threading.current_thread() is threading.main_thread()
    if not main or _sig.getsignal(_SIGINT) is not signal.default_int_handler:
        yield
        return
    pressed: list[int] = []

    def hold(signum, frame):
        if pressed:  # pressed twice: the work may be stuck, stop now
            raise KeyboardInterrupt
        pressed.append(signum)

    _sig.signal(_SIGINT, hold)
    try:
        yield
    finally:
        _sig.signal(_SIGINT, signal.default_int_handler)
    if pressed and reraise:
        raise KeyboardInterrupt
