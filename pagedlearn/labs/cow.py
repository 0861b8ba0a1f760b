"""Lab 2 · Fork and copy-on-write: share blocks between sequences, copy only on a write.

You write the sharing half of :class:`~pagedlearn.core.kv_cache_manager.KVCacheManager`, chapter 03
(``03_copy_on_write``) in code:

- ``fork`` -- ``fork`` (the child's table is a copy of the parent's, pointing at the same
  blocks: one reference more each, no KV copied) and ``free_sequence`` (one reference less per
  block, the *last* block first: a sequence's tail is the least likely to be shared, so it
  should be the first evicted when its blocks stay cached);
- ``cow`` -- ``append_token``: a token goes into the last block if it has room; on a block
  boundary a new block is allocated; the first write into a *shared, partly filled* last block
  copies it first (a fresh block, a pending ``(src, dst)`` copy, one reference less on ``src``),
  and the last sharer left writes in place. It returns the token's slot;
- ``plan`` -- ``blocks_to_append``: how many blocks appending one token to each of some
  sequences would allocate, without doing it (``min(k, r - 1)`` copies for a block with ``r``
  sharers of which ``k`` write).

What the checks look at. Your manager and the reference's get the same calls (``add_sequence``,
``append_token``, ``fork``, ``free_sequence``, ``pop_copies``); after each one they are
compared on what it returned or raised, the sequences and their block tables and tokens, every
block's refcount, the pending copies, the free queue in order, the prefix cache, the
``cow_copies`` counter and the trace events the call emitted (the live view draws from those).
Your manager runs where your code runs (the grader's sandbox has no reference code), so it is
all yours: ``cow``'s checks fork with your ``fork`` -- take the exercises in order. A failure's
picture shows both pools (``pool_state``).
"""

from __future__ import annotations

from pagedlearn.core.kv_cache_manager import KVCacheManager as RefKV
from pagedlearn.labs.lab import CheckFailed, Exercise, Lab, crashed, explore
from pagedlearn.labs.twins import Held, Twins

LAB = Lab(
    id="cow",
    number=2,
    title="Fork and copy-on-write",
    chapter="03_copy_on_write",
    files=("pagedlearn/core/kv_cache_manager.py",),
    exercises=(
        Exercise(
            "fork",
            "Share a sequence's blocks, and give them back",
            {
                "KVCacheManager.fork": (
                    "make child_id share all of parent_id's blocks: check the parent "
                    "(self._seqs.on_gpu) and the new id (self._seqs.check_new) first, add one "
                    "reference per block, add a copy of the parent's table with its extra keys, "
                    "emit self._events.incref(parent_id, child_id, blocks); copy no KV"
                ),
                "KVCacheManager.free_sequence": (
                    "drop one reference per block, LAST block first (from the CPU pool if the "
                    "sequence is swapped out), emit self._events.free(seq_id, blocks, cpu=...) "
                    "with the blocks in that order, then forget the sequence"
                ),
            },
        ),
        Exercise(
            "cow",
            "Append a token: fill the block, take a new one, or copy on write",
            {
                "KVCacheManager.append_token": (
                    "add one token and return its slot: on a block boundary take a new block "
                    "(self._allocate, an allocate event); into a shared partly filled last "
                    "block copy first (new block, pending (src, dst) in self._copies, one "
                    "reference less on src, count cow_copies, a cow_copy event); when a block "
                    "fills up and prefix caching is on, call self._cache_full_block"
                ),
            },
        ),
        Exercise(
            "plan",
            "How many blocks the next step needs",
            {
                "KVCacheManager.blocks_to_append": (
                    "return how many blocks appending one token to each id (in order) would "
                    "allocate, changing nothing: new blocks for full last blocks, plus min(k, "
                    "r - 1) copies of a shared partial last block with refcount r that k "
                    "sequences write into"
                ),
            },
        ),
    ),
)


def _snapshot(kv, events: list) -> dict:
    seqs = sorted(kv.sequences(), key=repr)
    a = kv.allocator
    cached = sorted(e.block_id for _, e in kv.prefix_cache.items()) if kv.prefix_cache else []
    snap = {
        "sequences": seqs,
        "block tables": {s: kv.block_table(s) for s in seqs},
        "token ids": {s: kv.token_ids(s) for s in seqs},
        f"refcounts of blocks 0..{a.num_blocks - 1}": [a.refcount(b) for b in range(a.num_blocks)],
        "pending copies (src, dst)": list(kv._copies),
        "free queue (next allocation first)": a.free_queue(),
        "blocks in the prefix cache": cached,
        "block hashes (how many per sequence)": {
            s: len(kv._seqs.table(s).block_hashes) for s in seqs
        },
        "cow_copies counter": kv.stats()["cow_copies"],
        "swapped-out sequences": sorted(kv.swapped_sequences(), key=repr),
    }
    if kv.cpu_allocator is not None:
        snap["CPU free queue"] = kv.cpu_allocator.free_queue()
    snap["trace events of that call"] = [  # short: "cow_copy [1, 2] ('b',)"
        f"{e.kind} {list(e.blocks)} {tuple(e.seqs)}"
        + "".join(f" {k}={v}" for k, v in sorted(e.info.items()))
        for e in events
    ]
    return snap


HINTS = {
    "fork": "fork copies no KV: the child's table names the parent's blocks, one reference more "
    "each",
    "free_sequence": "free_sequence drops one reference per block, the last block first",
    "append_token": "a token goes into the last block if it has room, else into a new block; a "
    "shared partly filled last block is copied first (copy-on-write)",
}


def _made(kwargs: dict) -> str:
    """How a manager was made, as messages say it: ``KVCacheManager(num_blocks=8, ...)``."""
    return "KVCacheManager(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")"


def _your_manager(sub, kwargs: dict) -> Held:
    """Your manager, built where your code runs, recording its trace events."""
    made = _made(kwargs)
    try:
        yours = sub.KVCacheManager(**kwargs)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        raise crashed([made], e) from e
    return Held(yours, _look, log=yours.record())


def _look(held: Held, before: bool = False):
    """Before a call: where its events start, and how many copies were pending; after it: the
    snapshot of the call's effect."""
    kv, log = held.obj, held.extra["log"]
    if before:
        return len(log.events), len(getattr(kv, "_copies", ()))
    start, copies = held.before
    snap = _snapshot(kv, log.events[start:])
    snap["_copied"] = len(getattr(kv, "_copies", ())) > copies  # for the hints, not compared
    return snap


class _Managers(Twins):
    """Your KV-cache manager and the reference's, made with the same arguments."""

    queries = frozenset({"blocks_to_append"})

    def __init__(self, sub, num_blocks: int, block_size: int, **options) -> None:
        kwargs = {"num_blocks": num_blocks, "block_size": block_size, **options}
        made = _made(kwargs)
        ref = RefKV(**kwargs)
        super().__init__(f"with {made}", ref, sub, _your_manager, kwargs)
        self.log, self.start, self.copies_before = ref.record(), 0, 0

    def context(self, name: str):
        self.start = len(self.log.events)
        self.copies_before = len(self.ref._copies)

    def snapshot(self, side: str) -> dict:
        return _snapshot(self.ref, self.log.events[self.start :])

    def state(self, obj):
        from dataclasses import replace

        from pagedlearn.viz.state import pool_state

        state = pool_state(obj)  # its refcounts count block tables; draw the allocator's
        counts = [obj.allocator.refcount(b.block_id) for b in state.blocks]
        blocks = tuple(replace(b, refcount=n) for b, n in zip(state.blocks, counts, strict=True))
        return replace(state, blocks=blocks)

    def _copied(self) -> tuple[bool, bool]:
        """Whether the call just made copied a block: (the reference, yours)."""
        return len(self.ref._copies) > self.copies_before, bool(self.last["snap"]["_copied"])

    def _copy_hint(self) -> str:
        ref, yours = self._copied()
        if yours and not ref:
            return (
                " (yours copied a block: only the first write into a SHARED, partly filled last "
                "block copies; the last sharer writes in place, a full last block gets a new one)"
            )
        if ref and not yours:
            return " (the last block is shared and partly filled: write into a copy of it)"
        return ""

    def result_hint(self, name: str, context, want, got) -> str:
        if name == "append_token":
            return self._copy_hint() or " (the slot is block * block_size + offset)"
        if name == "blocks_to_append":
            return (
                " (a full last block needs a new block; a partly filled one the sequence owns "
                "alone needs nothing; a shared one with refcount r that k sequences write into "
                "costs min(k, r - 1) copies)"
            )
        return ""

    def hint(self, field: str, want, got, name: str) -> str:
        if field.startswith("free queue") and sorted(want) == sorted(got):
            return (
                " (the same blocks in another order: free_sequence frees a sequence's LAST "
                "block first -- its tail is the least likely to be shared, so it should be "
                "evicted first)"
            )
        if field == "blocks in the prefix cache":
            return " (a block that fills up with prefix caching on must be registered)"
        if field.startswith("trace events"):
            order = "free_sequence lists the blocks LAST first; " * (name == "free_sequence")
            return f" ({order}the live view and replays draw from these events)"
        if name == "append_token" and (copy := self._copy_hint()):
            return copy
        if name == "append_token" and field.startswith("refcounts") and all(self._copied()):
            return " (a copy-on-write moves the writer from src to dst: one reference less on src)"
        return f" ({HINTS[name]})" if name in HINTS else ""


def _script(sub, calls, *config, **options) -> _Managers:
    kv = _Managers(sub, *config, **options)
    for name, *args in calls:
        kv.call(name, *args)
    return kv


A5 = ("add_sequence", "a", [1, 2, 3, 4, 5])


# --- fork ---------------------------------------------------------------------------------------
@LAB.check("fork", points=2)
def fork_shares_every_block(sub):
    calls = [A5, ("fork", "a", "b"), ("fork", "b", "c"), ("add_sequence", "d", [7, 8])]
    _script(sub, calls, 8, 4)


@LAB.check("fork", points=2)
def fork_refuses_bad_ids_and_changes_nothing(sub):
    calls = [A5, ("fork", "x", "b"), ("fork", "a", "a"), ("add_sequence", "b", [6])]
    calls += [("fork", "a", "b"), ("fork", "a", ["c"]), ("fork", "b", "c")]
    _script(sub, calls, 8, 4)


@LAB.check("fork", points=2)
def free_sequence_drops_one_reference_per_block(sub):
    calls = [A5, ("fork", "a", "b"), ("free_sequence", "a"), ("free_sequence", "a")]
    calls += [("add_sequence", "c", [1, 2, 3]), ("free_sequence", "b"), ("swap_out", ["c"])]
    calls += [("free_sequence", "c"), ("add_sequence", "d", [4])]
    _script(sub, calls, 6, 2, num_cpu_blocks=4)


@LAB.check("fork", points=2)
def free_sequence_frees_the_tail_first(sub):
    calls = [("add_sequence", "a", [1, 2, 3, 4, 5, 6, 7]), ("free_sequence", "a")]
    calls += [("add_sequence", "c", [9, 9, 9]), ("add_sequence", "d", [1, 2, 3, 4, 5])]
    _script(sub, calls, 5, 2, enable_prefix_caching=True)


# --- cow ----------------------------------------------------------------------------------------
@LAB.check("cow", points=2)
def append_fills_the_last_block_then_takes_a_new_one(sub):
    calls = [("add_sequence", "a", [1, 2, 3]), ("append_token", "a", 4), ("append_token", "a", 5)]
    calls += [("add_sequence", "b", [6]), ("append_token", "a", 6), ("append_token", "b", 7)]
    _script(sub, calls, 8, 4)


@LAB.check("cow", points=3)
def first_write_into_a_shared_partial_block_copies(sub):
    calls = [A5, ("fork", "a", "b"), ("append_token", "b", 9), ("pop_copies",)]
    calls += [("fork", "b", "c"), ("fork", "b", "d"), ("append_token", "c", 8)]
    _script(sub, calls, 8, 4)


@LAB.check("cow", points=2)
def last_sharer_writes_in_place(sub):
    calls = [A5, ("fork", "a", "b"), ("fork", "a", "c"), ("append_token", "b", 9)]
    calls += [("append_token", "a", 7), ("append_token", "c", 8), ("append_token", "a", 6)]
    _script(sub, calls, 8, 4)


@LAB.check("cow", points=2)
def a_shared_full_block_is_not_copied(sub):
    calls = [("add_sequence", "a", [1, 2, 3, 4]), ("fork", "a", "b"), ("append_token", "b", 9)]
    calls += [("append_token", "a", 5), ("append_token", "a", 6)]
    _script(sub, calls, 8, 4)


@LAB.check("cow", points=2)
def append_errors_change_nothing(sub):
    calls = [("add_sequence", "a", [1, 2, 3]), ("fork", "a", "b"), ("add_sequence", "c", [5])]
    calls += [("append_token", "b", 9), ("append_token", "c", 6), ("append_token", "c", 7)]
    calls += [("append_token", "x", 1), ("append_token", "c", -1), ("free_sequence", "a")]
    calls += [("append_token", "b", 9)]
    _script(sub, calls, 3, 2)


@LAB.check("cow", points=2)
def a_block_that_fills_up_is_cached(sub):
    calls = [("add_sequence", "a", [1, 2, 3]), ("append_token", "a", 4), ("append_token", "a", 5)]
    calls += [("add_sequence", "b", [1, 2, 3, 4, 5]), ("fork", "b", "c"), ("append_token", "c", 6)]
    _script(sub, calls, 8, 2, enable_prefix_caching=True)


# --- plan ---------------------------------------------------------------------------------------
@LAB.check("plan", points=2)
def blocks_to_append_counts_new_blocks_and_copies(sub):
    calls = [("add_sequence", "a", [1, 2, 3, 4, 5, 6]), ("fork", "a", "b"), ("fork", "a", "c")]
    calls += [("blocks_to_append", ["a"]), ("blocks_to_append", ["a", "b", "c"])]
    calls += [("blocks_to_append", ["b", "b"]), ("add_sequence", "d", [1, 2, 3, 4])]
    calls += [("blocks_to_append", ["a", "d"]), ("blocks_to_append", ["d"] * 5)]
    calls += [("blocks_to_append", []), ("blocks_to_append", ["a", "x"])]
    calls += [("blocks_to_append", "ab"), ("append_token", "b", 9), ("blocks_to_append", ["a"])]
    calls += [("blocks_to_append", ["b"]), ("blocks_to_append", ["c", "a", "b", "c"])]
    _script(sub, calls, 12, 4)


# --- random call sequences, shrunk --------------------------------------------------------------
MAX_EXAMPLES = 200


def _kv_calls(kinds: list[str]):
    from hypothesis import strategies as st

    # At least 8 drawn calls, so that blocks get shared, filled, copied and freed; "skip" (no
    # call) comes first, so that shrinking turns the calls a failure does not need into nothing.
    op = st.tuples(
        st.sampled_from(["skip", *kinds]),
        st.integers(0, 5),
        st.lists(st.integers(0, 9), min_size=1, max_size=4),
    )
    config = st.tuples(st.integers(3, 8), st.integers(2, 4), st.booleans())
    return st.tuples(config, st.lists(op, min_size=8, max_size=16))


def _resolve(kv, kind: str, flag: int, ints: list[int], fresh: str):
    """A concrete call aimed at the reference manager's state; ``flag == 5`` (1 in 6) asks for
    an error (an unknown or taken id, a bad token)."""
    seqs = sorted(kv.sequences())
    pick = seqs[ints[0] % len(seqs)] if seqs else "x"
    bad = flag == 5
    if kind == "add_sequence":
        flavour, n = ints[-1] % 3, 1 + ints[0] % 9  # prompts of one flavour share a prefix
        return (kind, pick if bad and seqs else fresh, [10 * flavour + i + 1 for i in range(n)])
    if kind == "append_token":
        return (kind, "x" if bad else pick, -1 if bad and ints[-1] % 2 else ints[-1])
    if kind == "fork":
        return (kind, "x" if bad and ints[-1] % 2 else pick, pick if bad else fresh)
    if kind == "free_sequence":
        return (kind, "x" if bad else pick)
    if kind == "blocks_to_append":
        return (kind, [*([] if not seqs else [seqs[i % len(seqs)] for i in ints]), *"x" * bad])
    return (kind,)  # pop_copies


def _explore(sub, kinds: list[str]) -> None:
    def run(example):
        (num_blocks, block_size, caching), drawn = example
        options = {"enable_prefix_caching": True} if caching else {}
        kv = _Managers(sub, num_blocks, block_size, **options)
        names = iter("abcdefghijklmnopqrstuvw")
        fresh = next(names)
        for kind, flag, ints in drawn:
            if kind != "skip":
                kv.call(*_resolve(kv.ref, kind, flag, ints, fresh))
            if fresh in kv.ref:
                fresh = next(names)

    explore(_kv_calls(kinds), run, max_examples=MAX_EXAMPLES)


@LAB.check("fork", points=3, timeout_s=40)
def fork_and_free_match_the_reference_on_random_calls(sub):
    _script(sub, [("add_sequence", "a", [1]), ("fork", "a", "b")], 4, 2)  # stubs stop here
    _explore(sub, ["add_sequence", "fork", "free_sequence", "append_token", "pop_copies"])


@LAB.check("cow", points=3, timeout_s=40)
def append_matches_the_reference_on_random_calls(sub):
    _script(sub, [("add_sequence", "a", [1]), ("append_token", "a", 2)], 4, 2)
    _explore(sub, ["add_sequence", "append_token", "fork", "free_sequence", "pop_copies"])


@LAB.check("plan", points=3, timeout_s=40)
def blocks_to_append_matches_the_reference_on_random_calls(sub):
    _script(sub, [("add_sequence", "a", [1]), ("blocks_to_append", ["a"])], 4, 2)
    kinds = ["add_sequence", "blocks_to_append", "fork", "append_token", "free_sequence"]
    _explore(sub, kinds)
