"""Lab 1 · The block pool and the block table: write the allocator a model can run on.

You write the heart of chapter 02 (``02_block_tables_and_the_allocator``):

- ``pool`` -- the three operations of :class:`~pagedlearn.core.block_allocator.BlockAllocator`:
  ``allocate`` (n blocks, all or nothing; empty blocks first, then cached blocks least recently
  freed, which evicts them), ``incref`` (one more reference; a free *cached* block comes back out
  of the free queue: a prefix-cache hit) and ``free`` (one reference less; at 0 the block joins
  the back of its queue). An operation that raises leaves the pool exactly as it was.
- ``table`` -- the slot arithmetic of :class:`~pagedlearn.core.block_table.BlockTable`:
  ``blocks_needed`` (a ceiling), ``slot`` and ``slot_mapping`` (from a position on, -1 where a
  sliding window freed the block: the engine asks it for every step's new tokens).

What the checks look at. Your pool and the reference's are driven by the same calls; after
each one they are compared on what the call returned (or the kind of error it raised), the
refcount of every block, the free queue *in order*, which blocks are cached, the counters
``num_shared_blocks`` and ``num_evictions``, and the ids handed to ``on_evict``. A few fixed
scenarios test one rule each; a property check draws random call sequences and, when one goes
wrong, shrinks it to the shortest. A failure's picture shows both pools: one table named
``references`` lists each used block once per reference (hatched ``x2`` when shared), free
cached blocks are grey.
"""

from __future__ import annotations

from pagedlearn.core.block_allocator import BlockAllocator as RefAllocator
from pagedlearn.labs.lab import CheckFailed, Exercise, Lab, crashed, explore
from pagedlearn.labs.twins import Held, Once, Twins

LAB = Lab(
    id="allocator",
    number=1,
    title="The block pool and the block table",
    chapter="02_block_tables_and_the_allocator",
    files=("pagedlearn/core/block_allocator.py", "pagedlearn/core/block_table.py"),
    exercises=(
        Exercise(
            "pool",
            "The block pool: allocate, share, free",
            {
                "BlockAllocator.allocate": (
                    "take n free blocks (refcount 0 -> 1): empty blocks first, then cached ones "
                    "least recently freed (an eviction: forget it is cached, count it, call "
                    "on_evict); all or nothing -- PagedLearnError for n not an int >= 0, "
                    "OutOfBlocksError when fewer than n are free"
                ),
                "BlockAllocator.incref": (
                    "add one reference per id (a free cached block leaves the free queue); "
                    "check every id first (self._check_ids), a free block that is not cached "
                    "cannot be shared: PagedLearnError, changing nothing; keep _num_shared"
                ),
                "BlockAllocator.free": (
                    "drop one reference per id; at 0 the block joins the back of its free "
                    "queue (cached or empty); a double free or a bad id raises "
                    "PagedLearnError, changing nothing; keep _num_shared"
                ),
            },
        ),
        Exercise(
            "table",
            "One sequence's block table: blocks and slots",
            {
                "BlockTable.blocks_needed": "return how many blocks num_tokens tokens occupy "
                "(round up)",
                "BlockTable.slot": "return the KV-slab row of token position i (physical block "
                "* block_size + offset); IndexError outside 0..num_tokens-1",
                "BlockTable.slot_mapping": "return the slot of every token position from "
                "start on, in order; -1 (NULL_BLOCK) where the table's entry is NULL_BLOCK; "
                "IndexError for a negative start",
            },
        ),
    ),
)


# --- the pool: drive yours and the reference's with the same calls ------------------------------
def allocator_state(pool):
    """A bare pool as the package's pictures draw it (a :class:`~pagedlearn.viz.state.PoolState`):
    one block table, ``references``, lists each used block once per reference; free cached
    blocks are drawn grey. ``draw_block_pool(allocator_state(pool))`` draws it."""
    from pagedlearn.viz.state import build_state

    n = pool.num_blocks
    refs = [b for b in range(n) for _ in range(pool.refcount(b))]
    cached = {b: "cached" for b in range(n) if pool.is_cached(b)}
    return build_state(n, 1, {"references": refs}, {"references": [0] * len(refs)}, {}, cached, {})


def _snapshot(pool, evicted: list[int]) -> dict:
    """What is compared after each call, in the order a difference is reported."""
    n = pool.num_blocks
    return {
        f"refcounts of blocks 0..{n - 1}": [pool.refcount(b) for b in range(n)],
        "free queue (next allocation first)": pool.free_queue(),
        "cached blocks": [b for b in range(n) if pool.is_cached(b)],
        "num_shared_blocks (refcount > 1)": pool.num_shared_blocks,
        "num_evictions": pool.num_evictions,
        "ids passed to on_evict": list(evicted),
    }


def _hint(field: str, want, got) -> str:
    """A sentence that names the likely mistake behind a difference in ``field``."""
    if field.startswith("free queue"):
        if sorted(want) == sorted(got):
            return (
                " (the same blocks in another order: a freed block joins the BACK of its queue, "
                "and allocate takes empty blocks first, then cached ones least recently freed)"
            )
        return " (a block belongs in the free queue exactly when its refcount is 0)"
    if field.startswith("num_shared"):
        return " (count a block when its refcount becomes 2, uncount it when it drops to 1)"
    if field.startswith("refcounts"):
        return " (allocate sets a refcount to 1, incref adds one, free drops one)"
    if field == "cached blocks":
        return " (an evicted block is no longer cached)"
    return ""


def _your_pool(sub, num_blocks: int) -> Held:
    """Your pool, built where your code runs, with a list of the ids its ``on_evict`` gets."""
    evicted: list[int] = []
    try:
        pool = sub.BlockAllocator(num_blocks, on_evict=evicted.append)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        raise crashed([f"BlockAllocator({num_blocks})"], e) from e
    return Held(pool, _look, evicted=evicted)


def _look(held: Held, before: bool = False):
    return None if before else _snapshot(held.obj, held.extra["evicted"])


class _Pools(Twins):
    """Your pool and the reference's."""

    def __init__(self, sub, num_blocks: int) -> None:
        self.evicted: list[int] = []
        ref = RefAllocator(num_blocks, on_evict=self.evicted.append)
        super().__init__(f"in a pool of {num_blocks} blocks", ref, sub, _your_pool, num_blocks)

    def snapshot(self, side: str) -> dict:
        return _snapshot(self.ref, self.evicted)

    def state(self, obj):
        return allocator_state(obj)

    def context(self, name: str):
        queue = self.ref.free_queue()
        return queue, [b for b in queue if self.ref.is_cached(b)]

    def result_hint(self, name: str, context, want, got) -> str:
        if name != "allocate":
            return ""
        queue, cached = context
        empty = [b for b in queue if b not in cached]
        return (
            f" (the free queue was: empty blocks {empty}, taken first, then cached blocks "
            f"{cached}, least recently freed first)"
        )

    def hint(self, field: str, want, got, name: str) -> str:
        return _hint(field, want, got)


def _script(sub, num_blocks: int, calls) -> _Pools:
    pools = _Pools(sub, num_blocks)
    for name, *args in calls:
        pools.call(name, *args)
    return pools


# --- the pool: one rule per check ---------------------------------------------------------------
@LAB.check("pool", points=1)
def allocate_takes_free_blocks_in_order(sub):
    _script(sub, 4, [("allocate", 2), ("allocate", 0), ("allocate",), ("allocate", 1)])


@LAB.check("pool", points=2)
def allocate_is_all_or_nothing(sub):
    _script(sub, 4, [("allocate", 3), ("allocate", 2), ("allocate", 1), ("allocate", 1)])
    _script(sub, 3, [("allocate", -1), ("allocate", 1.5), ("allocate", 4), ("allocate", 3)])


@LAB.check("pool", points=1)
def free_puts_blocks_at_the_back(sub):
    _script(sub, 4, [("allocate", 4), ("free", [2]), ("free", [0, 3]), ("allocate", 1)])


@LAB.check("pool", points=2)
def shared_blocks_are_freed_by_their_last_reference(sub):
    calls = [("allocate", 3), ("incref", [1]), ("incref", Once([1, 2])), ("free", [1])]
    calls += [("free", Once([1, 2])), ("free", [1]), ("free", [2]), ("allocate", 1)]
    _script(sub, 3, calls)


@LAB.check("pool", points=2)
def free_refuses_double_frees_and_bad_ids(sub):
    calls = [("allocate", 2), ("incref", [0]), ("free", [2]), ("free", [1, 1]), ("free", [0, 1])]
    calls += [("free", [0, 0, 0]), ("free", [1, 9]), ("free", [-1]), ("free", [0, 1])]
    _script(sub, 3, calls)


@LAB.check("pool", points=2)
def incref_shares_used_and_cached_blocks_only(sub):
    calls = [("allocate", 2), ("incref", [2]), ("incref", [0, 3]), ("incref", [1, 5])]
    calls += [("mark_cached", 1), ("free", [1]), ("incref", [1]), ("incref", [1]), ("free", [1])]
    _script(sub, 4, calls)


@LAB.check("pool", points=2)
def cached_blocks_are_evicted_least_recently_freed_first(sub):
    calls = [("allocate", 5), ("mark_cached", 1), ("mark_cached", 3), ("mark_cached", 4)]
    calls += [("free", [3]), ("free", [0]), ("free", [1, 4]), ("allocate", 1), ("allocate", 1)]
    calls += [("free", [0]), ("allocate", 2), ("allocate", 1), ("free", [1, 3])]
    _script(sub, 5, calls)


def _pool_ops():
    from hypothesis import strategies as st

    # At least 8 calls, so that blocks get cached, freed and evicted; "skip" (no call) comes
    # first, so that shrinking turns the calls a failure does not need into nothing.
    kinds = st.sampled_from(["skip", "allocate", "free", "incref", "mark_cached"])
    op = st.tuples(kinds, st.integers(0, 5), st.lists(st.integers(0, 7), min_size=1, max_size=3))
    return st.tuples(st.integers(2, 5), st.lists(op, min_size=8, max_size=16))


def _resolve(pool, kind: str, flag: int, ints: list[int]) -> list[tuple]:
    """Concrete calls from a drawn one, aimed at the reference pool's current state so that
    most calls are valid and blocks get cached, freed and evicted; ``flag == 5`` (1 in 6) draws
    raw ids or counts instead (errors welcome)."""
    n, raw = pool.num_blocks, [i - 1 for i in ints]  # raw ids: -1 .. 6
    used = [b for b in range(n) if pool.refcount(b) > 0]
    if kind == "skip":
        return []
    if kind == "allocate":
        free = pool.num_free_blocks
        return [(kind, raw[0] if flag == 5 else free if flag == 4 else (ints[0] + 1) % (free + 2))]
    if kind == "mark_cached":  # half the time the block is freed at once: a cached free block
        fresh = [b for b in used if not pool.is_cached(b)]
        b = fresh[ints[0] % len(fresh)] if fresh else None
        return [] if b is None else [(kind, b)] + [("free", [b])] * (flag < 3)
    pick = used if kind == "free" else used + [b for b in range(n) if pool.is_cached(b)]
    if flag == 5 or not pick:
        return [(kind, raw)]
    return [(kind, [pick[i % len(pick)] for i in ints])]


@LAB.check("pool", points=3, timeout_s=30)
def pool_matches_the_reference_on_random_calls(sub):
    _script(sub, 3, [("allocate", 2), ("incref", [0]), ("free", [0, 1])])  # a stub stops here

    def run(example):
        num_blocks, drawn = example
        pools = _Pools(sub, num_blocks)
        for kind, flag, ints in drawn:
            for call in _resolve(pools.ref, kind, flag, ints):
                pools.call(*call)

    explore(_pool_ops(), run, max_examples=300)


# --- the block table ----------------------------------------------------------------------------
def _table(sub, block_size: int, block_ids: list[int], num_tokens: int):
    return sub.BlockTable(block_size, list(block_ids), list(range(100, 100 + num_tokens)))


def _describe(block_size: int, block_ids: list[int], num_tokens: int) -> str:
    return f"BlockTable(block_size={block_size}, block_ids={block_ids}, {num_tokens} tokens)"


@LAB.check("table", points=1)
def blocks_needed_rounds_up(sub):
    for bs in (1, 2, 4, 16):
        for n in sorted({0, 1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs - 1, 5 * bs + 2}):
            table = _ask(f"BlockTable(block_size={bs})", "__init__", sub.BlockTable, bs)
            want = -(-n // bs)
            got = _ask(
                f"BlockTable(block_size={bs})", f"blocks_needed({n})", table.blocks_needed, n
            )
            if got != want:
                part = " and part of one more" if n % bs else ""
                raise CheckFailed(
                    f"BlockTable(block_size={bs}).blocks_needed({n}) should be {want} ({n} "
                    f"tokens fill {n // bs} whole blocks{part}); yours is {got!r}"
                )


def _ask(name: str, call: str, fn, *args):
    """``fn(*args)``; an exception other than IndexError becomes a verdict naming the call."""
    try:
        return fn(*args)
    except (CheckFailed, NotImplementedError, IndexError):
        raise
    except Exception as e:
        raise crashed([f"{name}.{call}"], e) from e


def _check_slots(sub, bs: int, ids: list[int], n: int) -> None:
    name = _describe(bs, ids, n)
    table = _ask(name, "__init__", _table, sub, bs, ids, n)
    for i in range(n):
        if ids[i // bs] == -1:  # freed by a sliding window: no slot to compute
            continue
        try:
            want, got = ids[i // bs] * bs + i % bs, _ask(name, f"slot({i})", table.slot, i)
        except IndexError as e:
            msg = f"{name}.slot({i}) should be {ids[i // bs] * bs + i % bs}; yours raised {e!r}"
            raise CheckFailed(msg) from None
        if got != want:
            raise CheckFailed(
                f"{name}.slot({i}) should be {want} (logical block {i // bs} is physical "
                f"block {ids[i // bs]}, offset {i % bs}: {ids[i // bs]} * {bs} + {i % bs}); "
                f"yours is {got!r}"
            )
    for i in (n, -1, n + bs):
        try:
            got = _ask(name, f"slot({i})", table.slot, i)
        except IndexError:
            continue
        raise CheckFailed(
            f"{name}.slot({i}) should raise IndexError (positions run 0..{n - 1}); yours "
            f"returned {got!r}"
        )
    want = [-1 if ids[i // bs] == -1 else ids[i // bs] * bs + i % bs for i in range(n)]
    for start in sorted({0, 1, bs, n // 2, n - 1, n} & set(range(n + 1))):
        call = f"slot_mapping({start})" if start else "slot_mapping()"
        try:
            got = _ask(name, call, table.slot_mapping, start)
        except IndexError as e:
            raise crashed([f"{name}.{call}"], e) from e
        if got != want[start:]:
            raise CheckFailed(f"{name}.{call} should be {want[start:]}; yours is {got!r}")
    try:
        got = _ask(name, "slot_mapping(-1)", table.slot_mapping, -1)
    except IndexError:
        return
    raise CheckFailed(f"{name}.slot_mapping(-1) should raise IndexError; yours returned {got!r}")


@LAB.check("table", points=2)
def slot_is_block_times_block_size_plus_offset(sub):
    _check_slots(sub, 4, [7, 2, 11], 10)  # the chapter's example: slot(5) == 9
    _check_slots(sub, 1, [3, 0, 2], 3)
    _check_slots(sub, 3, [0, 5], 6)
    _check_slots(sub, 4, [-1, -1, 11], 10)  # a sliding window freed the first two blocks


@LAB.check("table", points=2, timeout_s=20)
def slots_match_the_reference_on_random_tables(sub):
    from hypothesis import strategies as st

    _check_slots(sub, 2, [1, 0], 3)  # a stub stops here, before hypothesis starts
    tables = st.tuples(st.integers(1, 5), st.integers(0, 13), st.permutations(list(range(16))))

    def run(example):
        bs, n, perm = example
        _check_slots(sub, bs, perm[: -(-n // bs)], n)

    explore(tables, run, max_examples=100)
