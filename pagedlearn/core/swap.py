"""Swapping: preemption by swap (the paper's section 4.5), the CPU pool and its copy order.

When the GPU pool runs dry mid-generation, the scheduler must take blocks back from a running
request. It can *recompute*: free the blocks and prefill the request again later. Or it can *swap*:
copy the request's blocks to a pool in CPU memory, free the GPU blocks, and copy them back when
there is room. The CPU pool is a second ``BlockAllocator`` of ``num_cpu_blocks`` blocks; a
swapped-out sequence keeps its table (tokens, block hashes), whose ids then name CPU blocks
(``SequenceTables.to_cpu`` / ``to_gpu`` move it). A request is swapped as a *group* (all its
samples at once), so blocks its samples share after ``fork`` are copied once and stay shared: a
CPU block's refcount counts the swapped tables that point at it, as on the GPU. A block the group
shares with another request (a prefix-cache hit) stays on the GPU for that request. A sliding
window's null entries (block_table.py) stay null in either pool.

``swap_out`` and ``swap_in`` copy nothing themselves: they return ``(src, dst)`` block pairs, and
the engine moves the KV before the next forward pass, in this order: swap-out copies (GPU -> CPU),
swap-in copies (CPU -> GPU), then copy-on-write copies (``pop_copies``). The order matters because
a GPU block freed by ``swap_out`` may be handed to ``swap_in`` in the same step: its old KV must
reach the CPU before the new KV lands in it. So within one step the scheduler swaps out before it
swaps in. Copy-on-write copies may be pending during a swap (a scheduler appends for one request,
then preempts another), except where the order would move the wrong KV, which raises: swapping
out a block that still waits for its copy-on-write KV, or swapping in while a block of a pending
copy-on-write is free (the swap-in could take it, and the later copy would read or overwrite it).

>>> from pagedlearn import KVCacheManager
>>> kv = KVCacheManager(num_blocks=4, block_size=2, num_cpu_blocks=4)
>>> kv.add_sequence("a", [1, 2, 3]); kv.fork("a", "b")
0
>>> kv.swap_out(["a", "b"])         # one CPU block per GPU block, shared blocks stay shared
[(0, 0), (1, 1)]
>>> kv.is_swapped("b"), kv.num_free_blocks, kv.cpu_allocator.refcount(1)
(True, 4, 2)
>>> kv.swap_in(["a", "b"])          # (cpu, gpu): new GPU blocks, shared by both again
[(0, 2), (1, 3)]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable

from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.core.block_table import NULL_BLOCK, BlockTable
from pagedlearn.core.sequence_tables import SequenceTables, id_list
from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.trace.block_events import BlockEvents


class SwapSpace:
    """The CPU swap pool of one GPU pool: ``cpu_allocator`` (None: no swapping) beside the GPU
    ``allocator``. ``pending_copies`` is the pool's copy-on-write list, read (never written) to
    refuse a swap whose copies would run in the wrong order. Each call is handed the asking
    manager's tables and event emitter (a hybrid model's groups share one swap space)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        cpu_allocator: BlockAllocator | None,
        pending_copies: list[tuple[int, int]],
    ) -> None:
        self.allocator = allocator
        self.cpu_allocator = cpu_allocator
        self.pending_copies = pending_copies

    def swap_out(
        self, seqs: SequenceTables, seq_ids: Iterable[Hashable], events: BlockEvents
    ) -> list[tuple[int, int]]:
        """Move a group of sequences (the samples of one request) to the CPU pool; returns the
        ``(gpu_block, cpu_block)`` copies to apply. Each distinct GPU block of the group gets one
        CPU block, referenced once per group table that points at it. The GPU blocks lose those
        references: blocks only the group used become free (cached ones stay findable), blocks
        another sequence shares stay for it. Raises :class:`OutOfBlocksError`, changing nothing,
        when the CPU pool lacks room.
        """
        ids = self._group(seqs, seq_ids, swapped=False, what="swap_out")
        tables = [seqs.gpu[s] for s in ids]
        refs = Counter(b for t in tables for b in t.live_blocks())  # GPU block -> group references
        self.check_copy_order("swap_out", reads=refs.keys())
        cpu = self.cpu_allocator
        if len(refs) > cpu.num_free_blocks:
            raise OutOfBlocksError(
                len(refs), cpu.num_free_blocks, cpu.num_blocks, what=f"swap_out({ids!r}) to CPU"
            )
        # Nothing below can fail. Counter keeps first-seen order: copies follow the tables.
        to_cpu = dict(zip(refs, cpu.allocate(len(refs)), strict=True))
        cpu.incref(to_cpu[b] for b, n in refs.items() for _ in range(n - 1))
        for s, t in zip(ids, tables, strict=True):
            gpu = t.live_blocks()
            self.allocator.free(gpu[::-1])  # tail first, as in free_sequence
            t.block_ids = _renamed(t.block_ids, to_cpu)
            seqs.to_cpu(s)
            events.swap_out(s, gpu, t.live_blocks())
        return list(to_cpu.items())

    def swap_in(
        self,
        seqs: SequenceTables,
        seq_ids: Iterable[Hashable],
        events: BlockEvents,
        allocate: Callable[[int, Hashable], list[int]],
        index_blocks: Callable[[Hashable, BlockTable], None],
    ) -> list[tuple[int, int]]:
        """Bring a swapped-out group back to the GPU; returns the ``(cpu_block, gpu_block)`` copies
        to apply. Each distinct CPU block gets one new GPU block from ``allocate(n, seq_id)`` (which
        may evict cached blocks), shared again by the tables that shared it; the CPU blocks are
        freed. ``index_blocks(seq_id, table)`` registers the group's full blocks in the prefix cache
        again (unless the same content is already indexed). Raises :class:`OutOfBlocksError`,
        changing nothing, when the GPU pool lacks room (ask ``blocks_to_swap_in`` first; a failed
        swap is not counted in ``allocation_failures``).
        """
        ids = self._group(seqs, seq_ids, swapped=True, what="swap_in")
        self.check_copy_order("swap_in")
        tables = [seqs.cpu[s] for s in ids]
        refs = Counter(b for t in tables for b in t.live_blocks())  # CPU block -> group references
        a = self.allocator
        if len(refs) > a.num_free_blocks:
            raise OutOfBlocksError(
                len(refs), a.num_free_blocks, a.num_blocks, what=f"swap_in({ids!r})"
            )
        # Nothing below can fail. Allocate per sequence, so that an evict event names the
        # sequence whose KV takes the block.
        to_gpu: dict[int, int] = {}
        for s, t in zip(ids, tables, strict=True):
            new = [c for c in t.live_blocks() if c not in to_gpu]
            to_gpu.update(zip(new, allocate(len(new), s), strict=True))
        a.incref(to_gpu[c] for c, n in refs.items() for _ in range(n - 1))
        self.cpu_allocator.free(c for t in tables for c in t.live_blocks())
        for s, t in zip(ids, tables, strict=True):
            cpu_blocks = t.live_blocks()
            t.block_ids = _renamed(t.block_ids, to_gpu)
            seqs.to_gpu(s)
            events.swap_in(s, t.live_blocks(), cpu_blocks)
            index_blocks(s, t)  # the KV is back: let other requests find it
        return list(to_gpu.items())

    def blocks_to_swap_in(self, seqs: SequenceTables, seq_ids: Iterable[Hashable]) -> int:
        """GPU blocks ``swap_in(seq_ids)`` would allocate: the group's distinct CPU blocks."""
        ids = self._group(seqs, seq_ids, swapped=True, what="blocks_to_swap_in")
        return len({b for s in ids for b in seqs.cpu[s].live_blocks()})

    def check_copy_order(self, what: str, reads: Iterable[int] | None = None) -> None:
        """Refuse a swap whose copies, run before the pending copy-on-write ones, would move the
        wrong KV (the module docstring's two cases)."""
        refcount = self.allocator.refcount
        for src, dst in self.pending_copies:
            if reads is not None and dst in reads:
                bad = f"block {dst} gets its KV from the pending copy-on-write {(src, dst)}"
            elif reads is None and not (refcount(src) and refcount(dst)):
                bad = f"the pending copy-on-write {(src, dst)} names a free block"
            else:
                continue
            raise PagedLearnError(
                f"{what}: {bad}, which runs after the swap copies: apply pop_copies() first"
            )

    def _group(
        self, seqs: SequenceTables, seq_ids: Iterable[Hashable], swapped: bool, what: str
    ) -> list[Hashable]:
        """Check a swap group: distinct ids, at least one, all swapped out or all on the GPU."""
        if self.cpu_allocator is None:
            raise PagedLearnError(f"{what}: swap needs num_cpu_blocks > 0")
        ids = id_list(seq_ids, what)
        if not ids:
            raise PagedLearnError(f"{what} needs at least one sequence id")
        for s in ids:
            if seqs.is_swapped(s) != swapped:
                state = "is not swapped out" if swapped else "is already swapped out"
                raise PagedLearnError(f"{what}: sequence {s!r} {state}")
        if len(set(ids)) != len(ids):
            twice = next(s for i, s in enumerate(ids) if s in ids[:i])
            raise PagedLearnError(f"{what}: sequence id {twice!r} is listed twice")
        return ids


def _renamed(block_ids: list[int], new_id: dict[int, int]) -> list[int]:
    """A table's entries in the other pool; a sliding window's null entries stay null."""
    return [b if b == NULL_BLOCK else new_id[b] for b in block_ids]
