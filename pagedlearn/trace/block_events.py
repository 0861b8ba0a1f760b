"""What the KV-cache manager announces: one method per kind of block event it emits.

The manager and swap.py say ``events.cow_copy(seq_id, src, dst)`` where they would otherwise spell
``trace.emit("cow_copy", (src, dst), (seq_id,))``: each method is one row of the table of event
kinds in trace/events.py (what ``blocks``, ``seqs`` and ``info`` hold), so the table and the code
that fills it can be read side by side, and the manager's methods read as what they do to the pool.

When nobody subscribes to the trace an event costs one ``if`` (in ``Trace.emit``); the events
with a costly payload, ``cache_store`` (a hex hash and a token list) and ``evict`` (a hex hash),
are not even built.

In a model with several KV-cache groups (kv_cache_groups.py) each group's manager announces its
events under the sequence id ``"<seq id>|<group>"`` (``BlockEvents(trace, group)``): to the
trace, the replay and the pictures, a sequence's table in each group is a table of its own.

>>> from pagedlearn.trace.events import EventLog, Trace
>>> trace = Trace(); log = EventLog(trace)
>>> BlockEvents(trace).cow_copy("a", 1, 2)
>>> log.events[0].kind, log.events[0].blocks, log.events[0].seqs
('cow_copy', (1, 2), ('a',))
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedlearn.trace.events import Trace


class BlockEvents:
    """Emits the manager's block events on ``trace`` (see trace/events.py for what each one
    means)."""

    def __init__(self, trace: Trace, group: str | None = None) -> None:
        self.trace = trace
        self.group = group  # None: a model with one KV-cache group, ids as they are

    def id(self, seq_id: Hashable) -> Hashable:
        """The id the trace knows the sequence by: itself, or ``"<seq id>|<group>"``."""
        return seq_id if self.group is None else group_seq_id(seq_id, self.group)

    def allocate(self, seq_id: Hashable, blocks: Sequence[int]) -> None:
        self.trace.emit("allocate", blocks, (self.id(seq_id),))

    def cache_hit(self, seq_id: Hashable, blocks: Sequence[int], skipped: int = 0) -> None:
        if skipped:  # a sliding window needs no block for its first `skipped` entries
            self.trace.emit("cache_hit", blocks, (self.id(seq_id),), skipped=skipped)
        else:
            self.trace.emit("cache_hit", blocks, (self.id(seq_id),))

    def incref(
        self, parent_id: Hashable, child_id: Hashable, blocks: Sequence[int], prefix: int = -1
    ) -> None:
        ids = (self.id(parent_id), self.id(child_id))
        if prefix < 0:  # fork: the child shares the whole table
            self.trace.emit("incref", blocks, ids)
        else:  # fork_prefix: the parent's first ``prefix`` entries
            self.trace.emit("incref", blocks, ids, prefix=prefix)

    def cow_copy(self, seq_id: Hashable, src: int, dst: int) -> None:
        self.trace.emit("cow_copy", (src, dst), (self.id(seq_id),))

    def free(self, seq_id: Hashable, blocks: Sequence[int], cpu: bool) -> None:
        if cpu:  # a swapped-out sequence finished: its CPU blocks, the GPU pool is untouched
            self.trace.emit("free", blocks, (self.id(seq_id),), cpu=True)
        else:
            self.trace.emit("free", blocks, (self.id(seq_id),))

    def window_free(self, seq_id: Hashable, blocks: Sequence[int], first: int) -> None:
        """A sliding window left ``blocks`` behind: the table's entries ``first...`` are null."""
        self.trace.emit("window_free", blocks, (self.id(seq_id),), first=first)

    def cache_store(
        self,
        seq_id: Hashable,
        block: int,
        block_hash: bytes,
        tokens: Sequence[int],
        parent: bytes | None = None,
    ) -> None:
        """``parent``: the hash the block chains on (``info["parent"]``, for the KV-cache event
        stream, kv_events/publisher.py; traces recorded before it have no such key)."""
        if self.trace.listening:  # skip the hex string and token list when nobody reads them
            more = {} if parent is None else {"parent": parent.hex()}
            self.trace.emit(
                "cache_store",
                (block,),
                (self.id(seq_id),),
                hash=block_hash.hex(),
                tokens=list(tokens),
                **more,
            )

    def evict(self, seq_id: Hashable, block: int, block_hash: bytes) -> None:
        if self.trace.listening:  # skip the hex string when nobody reads it
            self.trace.emit("evict", (block,), (self.id(seq_id),), hash=block_hash.hex())

    def swap_out(self, seq_id: Hashable, gpu_blocks: Sequence[int], cpu_blocks: list[int]) -> None:
        self.trace.emit("swap_out", gpu_blocks, (self.id(seq_id),), cpu_blocks=list(cpu_blocks))

    def swap_in(self, seq_id: Hashable, gpu_blocks: Sequence[int], cpu_blocks: list[int]) -> None:
        self.trace.emit("swap_in", gpu_blocks, (self.id(seq_id),), cpu_blocks=cpu_blocks)


def group_seq_id(seq_id: Hashable, group: str) -> str:
    """``"<seq id>|<group>"``: how the trace names a sequence's table in one KV-cache group."""
    return f"{seq_id}{GROUP_SEPARATOR}{group}"


def split_group_seq_id(traced_id: Hashable) -> tuple[Hashable, str | None]:
    """``(seq id, group)`` from an id of the trace; ``(id, None)`` for a one-group model's.

    >>> split_group_seq_id("0:1|sliding 24"), split_group_seq_id("a"), split_group_seq_id(3)
    (('0:1', 'sliding 24'), ('a', None), (3, None))
    """
    if isinstance(traced_id, str) and GROUP_SEPARATOR in traced_id:
        seq_id, group = traced_id.rsplit(GROUP_SEPARATOR, 1)
        return seq_id, group
    return traced_id, None


GROUP_SEPARATOR = "|"
