"""The pool rebuilt from events alone: :class:`PoolReplay`.

Apply the events of a trace (what each kind means: the table in :mod:`pagedlearn.trace.events`) one
by one to an empty pool, and you get back what the KV-cache manager holds -- every block's refcount,
every sequence's block table (with the null entries, -1, a sliding window left), the cached
blocks' hashes and tokens, the tables of swapped-out
sequences -- and, from the ``step`` events, every sequence's tokens. The replay knows nothing of
the manager's code, which is the point: if the manager forgot to announce an operation, the two
would drift apart, and the tests compare them after every random operation
(tests/test_stateful.py). The same replay draws a recorded run frame by frame (``replay_states``
in viz/state.py) and checks a trace file once as it loads (``EventLog.from_json``).

Rules worth knowing:

- Each event is checked against the pool as it stands *before* anything changes
  (:func:`~pagedlearn.trace.checks.check_event`): one that does not fit -- a block outside the
  pool, a sequence the replay never saw, a free that is not the sequence's table -- raises
  :class:`~pagedlearn.errors.TraceFileError` and leaves the replay as it was.
- A ``preempt`` changes nothing here: it says *why* blocks moved; the ``free`` or ``swap_out``
  beside it says how.
- An ``evict`` of a block the replay never saw cached is allowed: a recording that began after
  an earlier run evicts what that run cached.
- A ``cache_reset`` makes every cached block a free, empty one: its hash and tokens are
  forgotten, as an eviction forgets them, but it is no eviction (nothing took the block).
- A table's null entries (-1) are real list entries (``tables`` is what the pictures draw), so
  building them costs their number: a ``cache_hit`` that skips entries builds them, and a fork
  copies its parent's; ``EventLog.from_json`` bounds how many a file may make (``check_replay``
  in trace/checks.py). Nothing else reads or copies them: a swap moves the table's list from
  one pool to the other, and every check reads only the entries an event lists.

A fork shares blocks; a write to a shared block copies it first (copy-on-write)::

    >>> from pagedlearn.trace.events import Event
    >>> pool = PoolReplay(num_blocks=4)
    >>> pool.apply(Event(0, "allocate", (0, 1), ("a",)))    # a's prompt fills blocks 0 and 1
    >>> pool.apply(Event(1, "incref", (0, 1), ("a", "b")))  # fork: b shares both
    >>> pool.refcounts, pool.tables, pool.free_blocks
    ([2, 2, 0, 0], {'a': [0, 1], 'b': [0, 1]}, [2, 3])
    >>> pool.apply(Event(2, "cow_copy", (1, 2), ("b",)))    # b writes its last block: a copy
    >>> pool.refcounts, pool.tables["b"]
    ([2, 1, 1, 0], [0, 2])
    >>> pool.apply(Event(3, "free", (0,), ("a",)))
    Traceback (most recent call last):
    pagedlearn.errors.TraceFileError: event 3 (free): names blocks [0], not the table of 'a'
    >>> pool.refcounts                                      # unchanged
    [2, 1, 1, 0]
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from itertools import repeat
from typing import Any

from pagedlearn.trace.checks import NULL, check_event, check_pool, null_head

# Events are pagedlearn.trace.events.Event records; this module reads only their ``kind``,
# ``blocks``, ``seqs`` and ``info`` and does not import trace/events.py, which imports it
# (EventLog.replay).


class PoolReplay:
    """The pool rebuilt from events alone: refcounts, block tables, cached hashes and the tables
    of swapped-out sequences (``swapped``: sequence -> CPU block ids).

    It knows nothing of the manager's code; if the trace missed an operation, this state would
    drift from the real one, which is what the tests check. An event that does not fit the pool
    as it stands (a block outside it, a sequence it never saw, a free of a block no table holds:
    ``check_event``) raises :class:`~pagedlearn.errors.TraceFileError` before anything
    changes. ``num_cpu_blocks``: the CPU pool's size, to check swapped-out tables against
    (unchecked when None).
    """

    def __init__(self, num_blocks: int, num_cpu_blocks: int | None = None) -> None:
        check_pool(num_blocks, num_cpu_blocks)  # before [0] * num_blocks: a file may say 10**12
        self.num_cpu_blocks = num_cpu_blocks
        self.refcounts = [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}
        self.swapped: dict[Hashable, list[int]] = {}  # swapped-out tables: CPU block ids
        self.cached: dict[int, str] = {}  # block id -> hash (hex) of the KV it holds
        self.cached_tokens: dict[int, list[int]] = {}  # block id -> the tokens of that KV
        # As of the last ``step`` event (empty before one): tokens with KV per sequence, and
        # what the caller said about that step (the engine: step number, requests, stats).
        self.tokens: dict[Hashable, list[int]] = {}
        self.step_info: dict[str, Any] = {}

    @classmethod
    def from_events(
        cls, num_blocks: int, events: Iterable, num_cpu_blocks: int | None = None
    ) -> PoolReplay:
        """A replay of ``events`` (``Event`` records, in order) from an empty pool."""
        state = cls(num_blocks, num_cpu_blocks)
        for event in events:
            state.apply(event)
        return state

    def apply(self, e) -> None:
        """Apply one event (an ``Event``), or raise ``TraceFileError`` (changing nothing)
        if it does not fit the pool as it stands."""
        check_event(self, e)
        rc = self.refcounts
        if e.kind in ("allocate", "cache_hit"):
            for b in e.blocks:
                rc[b] += 1
            table = self.tables.setdefault(e.seqs[0], [])
            if e.kind == "cache_hit" and e.info.get("skipped"):  # entries a sliding window skips
                table.extend(repeat(NULL, e.info["skipped"]))  # built in place: no copy of them
            table.extend(e.blocks)
        elif e.kind == "incref":
            for b in e.blocks:
                rc[b] += 1
            parent = self.tables[e.seqs[0]]  # null entries included; fork_prefix: a prefix
            self.tables[e.seqs[1]] = parent[: e.info.get("prefix", len(parent))]
        elif e.kind == "window_free":  # a sliding window left these blocks behind
            for b in e.blocks:
                rc[b] -= 1
            first = e.info["first"]
            self.tables[e.seqs[0]][first : first + len(e.blocks)] = [NULL] * len(e.blocks)
        elif e.kind == "cow_copy":
            src, dst = e.blocks
            rc[src] -= 1
            rc[dst] += 1
            self.tables[e.seqs[0]][-1] = dst
        elif e.kind == "free" and e.info.get("cpu"):  # a swapped-out sequence: GPU untouched
            del self.swapped[e.seqs[0]]
        elif e.kind == "free":
            for b in e.blocks:
                rc[b] -= 1
            del self.tables[e.seqs[0]]
        elif e.kind == "swap_out":
            for b in e.blocks:
                rc[b] -= 1
            # The same list moves to the other pool: its null head stays (no copy of it), its
            # blocks become the CPU blocks that now hold their KV.
            table = self.swapped[e.seqs[0]] = self.tables.pop(e.seqs[0])
            table[null_head(table) :] = e.info["cpu_blocks"]
        elif e.kind == "swap_in":
            for b in e.blocks:
                rc[b] += 1
            table = self.tables[e.seqs[0]] = self.swapped.pop(e.seqs[0])
            table[null_head(table) :] = e.blocks
        elif e.kind == "preempt":
            pass  # why blocks moved; the free or swap_out events around it say how
        elif e.kind == "step":
            # Each entry is (sequence, position, tokens): its tokens from that position on. The
            # sequences absent from ``num_tokens`` are gone, and are forgotten here too.
            # The lists grow in place: a long sequence costs its new tokens per step, not all.
            tokens = {s: self.tokens.get(s, []) for s, _ in e.info["num_tokens"]}
            for s, start, new in e.info["new_tokens"]:
                del tokens[s][start:]
                tokens[s].extend(new)
            self.tokens = tokens
            self.step_info = {
                k: v for k, v in e.info.items() if k not in ("num_tokens", "new_tokens")
            }
        elif e.kind == "cache_store":
            self.cached[e.blocks[0]] = e.info["hash"]
            self.cached_tokens[e.blocks[0]] = list(e.info.get("tokens", ()))
        elif e.kind == "evict":  # a recording that began after an earlier run may evict
            self.cached.pop(e.blocks[0], None)  # a block cached before it: never seen cached
            self.cached_tokens.pop(e.blocks[0], None)
        elif e.kind == "cache_reset":  # the same leniency: blocks cached before the recording
            for b in e.blocks:
                self.cached.pop(b, None)
                self.cached_tokens.pop(b, None)

    @property
    def free_blocks(self) -> list[int]:
        return [b for b, c in enumerate(self.refcounts) if c == 0]
