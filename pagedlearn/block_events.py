"""What the KV-cache manager announces: one method per kind of block event it emits.

The manager and swap.py say ``events.cow_copy(seq_id, src, dst)`` where they would otherwise spell
``trace.emit("cow_copy", (src, dst), (seq_id,))``: each method is one row of the table of event
kinds in trace.py (what ``blocks``, ``seqs`` and ``info`` hold), so the table and the code that
fills it can be read side by side, and the manager's methods read as what they do to the pool.

When nobody subscribes to the trace an event costs one ``if`` (in ``Trace.emit``); the one event
with a costly payload, ``cache_store`` (a hex hash and a token list), is not even built.

>>> from pagedlearn.trace import EventLog, Trace
>>> trace = Trace(); log = EventLog(trace)
>>> BlockEvents(trace).cow_copy("a", 1, 2)
>>> log.events[0].kind, log.events[0].blocks, log.events[0].seqs
('cow_copy', (1, 2), ('a',))
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedlearn.trace import Trace


class BlockEvents:
    """Emits the manager's block events on ``trace`` (see trace.py for what each one means)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def allocate(self, seq_id: Hashable, blocks: Sequence[int]) -> None:
        self.trace.emit("allocate", blocks, (seq_id,))

    def cache_hit(self, seq_id: Hashable, blocks: Sequence[int]) -> None:
        self.trace.emit("cache_hit", blocks, (seq_id,))

    def incref(self, parent_id: Hashable, child_id: Hashable, blocks: Sequence[int]) -> None:
        self.trace.emit("incref", blocks, (parent_id, child_id))  # fork

    def cow_copy(self, seq_id: Hashable, src: int, dst: int) -> None:
        self.trace.emit("cow_copy", (src, dst), (seq_id,))

    def free(self, seq_id: Hashable, blocks: Sequence[int], cpu: bool) -> None:
        if cpu:  # a swapped-out sequence finished: its CPU blocks, the GPU pool is untouched
            self.trace.emit("free", blocks, (seq_id,), cpu=True)
        else:
            self.trace.emit("free", blocks, (seq_id,))

    def cache_store(
        self, seq_id: Hashable, block: int, block_hash: bytes, tokens: Sequence[int]
    ) -> None:
        if self.trace.listening:  # skip the hex string and token list when nobody reads them
            self.trace.emit(
                "cache_store", (block,), (seq_id,), hash=block_hash.hex(), tokens=list(tokens)
            )

    def evict(self, seq_id: Hashable, block: int, block_hash: bytes) -> None:
        self.trace.emit("evict", (block,), (seq_id,), hash=block_hash.hex())

    def swap_out(self, seq_id: Hashable, gpu_blocks: Sequence[int], cpu_blocks: list[int]) -> None:
        self.trace.emit("swap_out", gpu_blocks, (seq_id,), cpu_blocks=list(cpu_blocks))

    def swap_in(self, seq_id: Hashable, gpu_blocks: Sequence[int], cpu_blocks: list[int]) -> None:
        self.trace.emit("swap_in", gpu_blocks, (seq_id,), cpu_blocks=cpu_blocks)
