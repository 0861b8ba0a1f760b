"""vLLM's KV-cache events: the stream a serving engine publishes about its prefix cache.

vLLM (``--kv-events-config``) announces every block it caches (``BlockStored``), every cached
block it drops (``BlockRemoved``) and a cleared cache (``AllBlocksCleared``), in batches, over
ZeroMQ. KV-cache-aware routers read that stream to send a prompt where its prefix is cached.
This package reads it, draws it, and lets pagedlearn's own engine speak it.

Reading order:

1. ``messages.py``   -- the wire format: the three events, a batch, encode / decode (with caps).
2. ``from_trace.py`` -- pagedlearn's block trace said as those events (and what they cannot say).
3. ``publisher.py``  -- the transport: PUB socket, sequence numbers, the replay socket;
   :func:`~pagedlearn.kv_events.publisher.publish_kv_events` and ``serve --kv-events-endpoint``.
4. ``subscriber.py`` -- following a publisher (vLLM's or ours): gaps, replay, bad input, status.
5. ``recording.py``  -- a stream saved to a file and read back, for a group without a server.
6. ``cache_state.py`` (the tree of cached blocks the events describe), ``cache_summary.py`` (its
   numbers and text, and a new prompt's hit opportunities), ``block_hashes.py`` (a prompt's
   hashes as vLLM or pagedlearn compute them, and what the stream hides), and the views in
   ``pagedlearn/viz/``: ``prefix_tree``, ``kv_events_timeline``, ``kv_events_live``.

The transport needs the ``[kv-events]`` extra (pyzmq, msgspec): ``pip install -e
".[kv-events]"``. Importing this package does not; a module that needs them says so in one line
(:func:`import_extra`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pagedlearn.errors import KVEventsError

INSTALL_HINT = 'pip install -e ".[kv-events]"'


def check_positive_ints(error: type[Exception] = KVEventsError, **values) -> None:
    """Raise ``error`` naming the first of ``values`` (name=value) that is not an int >= 1 (a
    bool is not an int here): the sizes and caps every class of this package takes.

    >>> check_positive_ints(block_size=0)
    Traceback (most recent call last):
    pagedlearn.errors.KVEventsError: block_size must be a positive int, got 0
    """
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise error(f"{name} must be a positive int, got {value!r}")


def import_extra(name: str) -> ModuleType:
    """Import ``zmq`` or ``msgspec``, or raise :class:`KVEventsError` with the one-line hint."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise KVEventsError(
            f"KV-cache events need {name!r}, part of the [kv-events] extra: {INSTALL_HINT}"
        ) from None
