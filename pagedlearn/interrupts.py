"""Holding Ctrl-C while a piece of work must finish whole.

A ``KeyboardInterrupt`` can land between any two bytecodes. Where that would leave state half
changed -- the engine's bookkeeping (engine/recovery.py), a message half written to a worker's
pipe or half read from it (parallel/executor.py) -- the work runs inside
:func:`held_interrupts`: Ctrl-C is noted, the work finishes, then the interrupt is raised.
"""

from __future__ import annotations

import contextlib
import signal
import threading

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
