"""Lab 3, ``prefix``: the prefix cache -- block hashes, verified lookups, lazy eviction.

Practises chapter 04 (``notebooks/04_prefix_caching``). The student writes six bodies of
``pagedlearn/core/prefix_cache.py``:

- ``hash``: ``hash_block`` (SHA-256 of the parent hash, the token ids and the extra keys, in the
  package's exact serialisation) and ``hash_blocks`` (the chain over the *full* blocks of a
  prompt; a partial tail has no hash yet);
- ``lookup``: ``PrefixCache.lookup`` (a hit verifies the stored parent, tokens and extra keys,
  so a hash collision costs a miss, never wrong KV) and ``PrefixCache.match`` (hits from the
  first block to the first miss, at most ``(len(tokens) - 1) // block_size`` blocks: the last
  token is always computed);
- ``evict``: ``PrefixCache.insert`` (the first block under a hash keeps it) and
  ``PrefixCache.evict`` (forget a block both ways when its slot is reused: lazy eviction).

What the checks look at. Each function alone first: exact hash values, pairs of inputs that must
hash apart, planted entries that collide, cached prompts with a hole in the middle. A check
isolates its target from the student's other answers where it can: entries are planted with the
reference's ``insert``, and ``match`` is run with the reference's ``lookup``. Then the whole
thing: a real :class:`~pagedlearn.KVCacheManager` whose ``prefix_cache_class`` is the student's,
driven beside the reference manager through fixed scenarios (a stale hit after eviction, cache
salts) and random operation sequences; reused tokens, slots, block tables, the cache's contents,
the allocator's LRU queue and its evictions must agree after every operation. (The LRU queue is
the allocator's, lab 1; the prefix cache's part of lazy eviction is to forget a block when the
allocator hands it out for new data.)
"""

from __future__ import annotations

from pagedlearn.core import prefix_cache as ref
from pagedlearn.labs.lab import CheckFailed, Exercise, Lab, explore
from pagedlearn.labs.prefix_managers import (  # the planted chain, names in messages, the manager
    E0,
    H1,
    H2,
    KEYS,
    LORA,
    ROOT,
    SALT1,
    SALT2,
    _held,
    _Managers,
    _match,
    attempt,
    call,
    chain,
    contents,
    name,
    plant,
    theirs,
)
from pagedlearn.labs.prefix_managers import your_manager as your_manager  # re-exported (tests)

LAB = Lab(
    id="prefix",
    number=3,
    title="The prefix cache: block hashes, verified lookups, lazy eviction",
    chapter="04_prefix_caching",
    files=("pagedlearn/core/prefix_cache.py",),
    exercises=(
        Exercise(
            "hash",
            "The block-hash chain",
            {
                "hash_block": "return the 32-byte SHA-256 digest of parent_hash, then "
                "struct.pack(f'<I{n}q', n, *token_ids) with n = len(token_ids), then "
                "repr(extra_keys).encode() -- in that order (this exact serialisation is checked)",
                "hash_blocks": "hash each FULL block j (token_ids[j * block_size:(j + 1) * "
                "block_size]) with hash_block, chained on parent_hash(hashes, j) (ROOT_HASH for "
                "block 0); a partial tail gets no hash",
            },
        ),
        Exercise(
            "lookup",
            "Verified lookup and the longest cached prefix",
            {
                "PrefixCache.lookup": "return the block_id of the entry stored under block_hash "
                "only if its parent_hash, token_ids (a tuple) and extra_keys all equal the "
                "arguments; otherwise None (a hash collision must be a miss)",
                "PrefixCache.match": "hashes = hash_blocks(...); look blocks 0, 1, ... up in "
                "order (self.lookup, parent_hash(hashes, j)), stop at the first miss, try at most "
                "(len(token_ids) - 1) // block_size blocks; return (hashes, hit block ids)",
            },
        ),
        Exercise(
            "evict",
            "Insert and lazy eviction",
            {
                "PrefixCache.insert": "if block_hash is stored already or block_id is indexed "
                "already, change nothing and return False; else store CachedBlock(block_id, "
                "parent_hash, tuple(token_ids), extra_keys) in self._by_hash[block_hash], "
                "block_hash in self._hash_of[block_id], and return True",
                "PrefixCache.evict": "forget block_id both ways (its hash in self._hash_of, "
                "that hash's entry in self._by_hash); return the hash, or None if it had none",
            },
        ),
    ),
)

# The message prefix of checks that plant the chain H1, H2 (as blocks 3 and 5).
PLANTED = "with H1 -> block 3 ([1, 2]) and H2 -> block 5 ([3, 4]) cached, "


# --- exercise "hash" ------------------------------------------------------------------------------
@LAB.check("hash", points=2, timeout_s=5)
def hash_block_matches_the_package_serialisation(sub):
    cases = [(ROOT, [1, 2, 3, 4], E0), (H1, (7,), SALT1), (ROOT, [], ()), (H2, [2**40, 0], LORA)]
    for args in cases:
        got, want = theirs(sub)(*args), ref.hash_block(*args)
        what = call("hash_block", *args)
        if not isinstance(got, bytes) or len(got) != 32:
            raise CheckFailed(f"{what} should return the 32-byte digest; yours is {got!r:.60}")
        if got != want:
            raise CheckFailed(
                f"{what} should be {want.hex()[:16]}..; yours is {got.hex()[:16]}.. -- the checks "
                "compare against the package's serialisation: hashlib.sha256(parent_hash), then "
                "update(struct.pack(f'<I{n}q', n, *token_ids)), update(repr(extra_keys).encode())"
            )


WHY_APART = {
    "parent": "a block's hash must chain on its parent (the same tokens after another prefix "
    "hold other KV)",
    "tokens": "a block's hash must change with its token ids, their order and their number",
    "extra": "extra keys must be hashed too, or tenants with different cache salts (or two "
    "adapters) would share KV",
}


@LAB.check("hash", points=2, timeout_s=5)
def hash_block_depends_on_parent_tokens_and_extra_keys(sub):
    hb = theirs(sub)
    pairs = [
        ("parent", (ROOT, [1, 2], E0), (H1, [1, 2], E0)),
        ("parent", (H1, [3, 4], E0), (H2, [3, 4], E0)),
        ("tokens", (ROOT, [1, 2], E0), (ROOT, [1, 3], E0)),
        ("tokens", (ROOT, [1, 2], E0), (ROOT, [2, 1], E0)),
        ("tokens", (ROOT, [1, 2], E0), (ROOT, [1, 2, 0], E0)),
        ("extra", (ROOT, [1, 2], E0), (ROOT, [1, 2], SALT1)),
        ("extra", (ROOT, [1, 2], SALT1), (ROOT, [1, 2], SALT2)),
        ("extra", (ROOT, [1, 2], E0), (ROOT, [1, 2], LORA)),
    ]
    for kind, a, b in pairs:
        if hb(*a) == hb(*b):
            what = f"{call('hash_block', *a)} and {call('hash_block', *b)}"
            raise CheckFailed(f"{what} are equal: {WHY_APART[kind]}")
    if hb(ROOT, (1, 2), E0) != hb(ROOT, [1, 2], E0):
        raise CheckFailed(
            f"{call('hash_block', ROOT, [1, 2], E0)} changes between calls (or between a list "
            "and a tuple of the same ids): a block hash must depend on the content only"
        )


@LAB.check("hash", points=2, timeout_s=20)
def hash_blocks_chains_each_block_on_the_previous(sub):
    from hypothesis import strategies as st

    def run(example):
        tokens, bs, extra = example
        what = f"hash_blocks({tokens}, {bs}, {KEYS[extra]})"
        got = list(attempt(what, sub.hash_blocks, tokens, bs, extra))
        want = chain(theirs(sub), tokens, bs, extra)  # *their* hash_block: this is about the chain
        j = next((j for j, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), None)
        if j is None and len(got) != len(want):
            tail = tokens[len(want) * bs :]
            raise CheckFailed(
                f"{what} should return {len(want)} hashes, one per full block"
                + (f" (the partial tail {tail} has none yet)" if tail else "")
                + f"; yours returned {len(got)}"
            )
        if j is not None:
            chunk = tokens[j * bs : (j + 1) * bs]
            on = "ROOT_HASH" if j == 0 else f"block {j - 1}'s hash"
            root = j > 0 and got[j] == sub.hash_block(ROOT, chunk, extra)
            raise CheckFailed(
                f"{what}: block {j} should be hash_block({on}, {chunk}, extra_keys) = "
                f"{name(want[j])}; yours is {name(got[j])}"
                + (" (yours chains it on ROOT_HASH instead)" if root else "")
            )

    extras = st.sampled_from([E0, SALT1])
    explore(st.tuples(st.lists(st.integers(0, 4), max_size=9), st.integers(1, 4), extras), run, 60)


# --- exercise "lookup" ----------------------------------------------------------------------------
@LAB.check("lookup", points=2, timeout_s=5)
def lookup_hits_only_on_identical_content(sub):
    cache = sub.PrefixCache()
    plant(cache, [1, 2, 3, 4], 2, [3, 5], sub=sub)
    before, h9 = contents(cache), ref.hash_block(ROOT, [9, 9], E0)
    cases = [  # (hash, parent, tokens, extra keys), the answer, why a miss is right
        ((H1, ROOT, [1, 2], E0), 3, ""),
        ((H2, H1, [3, 4], E0), 5, ""),
        ((h9, ROOT, [9, 9], E0), None, "nothing is stored under that hash"),
        ((H1, ROOT, [1, 9], E0), None, "the entry under H1 holds tokens (1, 2)"),
        ((H2, ROOT, [3, 4], E0), None, "the entry under H2 follows parent H1, not ROOT_HASH"),
        ((H1, ROOT, [1, 2], SALT1), None, "the entry under H1 was stored for other extra keys"),
    ]
    for (h, *args), want, why in cases:
        what = f"lookup({name(h)}, {call('', *args)[1:]}"
        got = attempt(what, cache.lookup, h, *args)
        if got != want or type(got) is not type(want):
            if want is not None:
                raise CheckFailed(f"{PLANTED}{what} should return {want}; yours gave {got!r:.60}")
            raise CheckFailed(
                f"{PLANTED}{what} should miss (None): {why}. A hash collision must cost a miss, "
                f"never hand out another prompt's KV; yours returned {got!r:.60}"
            )
    if contents(cache) != before:
        raise CheckFailed(f"{PLANTED}your lookups changed the cache: a lookup changes nothing")


@LAB.check("lookup", points=2, timeout_s=5)
def match_stops_at_the_first_miss(sub):
    tokens = [1, 2, 3, 4, 5, 6, 7]  # blocks [1, 2] [3, 4] [5, 6], tail [7]
    for skip, want in [((), [10, 11, 12]), ((1,), [10]), ((0,), []), ((2,), [10, 11])]:
        held = [j for j in range(3) if j not in skip]
        setup = f"with blocks {held} of {tokens} cached (as {[10 + j for j in held]}), "
        got = _match(sub, tokens, 2, [(tokens, [10, 11, 12], E0, skip)], setup=setup)
        if got != want:
            raise CheckFailed(
                f"{setup}match({tokens}, block_size=2, ...) should hit {want}; yours hits {got}: "
                "hits run from the first block to the first miss"
            )


@LAB.check("lookup", points=2, timeout_s=5)
def match_never_covers_the_last_token(sub):
    for bs in (2, 3):
        for n in range(1, 8):
            tokens, blocks = list(range(1, n + 1)), list(range(20, 20 + n // bs))
            setup = f"with all {n // bs} full blocks of {tokens} cached (as {blocks}), "
            got, want = (
                _match(sub, tokens, bs, [(tokens, blocks)], setup=setup),
                blocks[: (n - 1) // bs],
            )
            if got != want:
                raise CheckFailed(
                    f"{setup}match({tokens}, block_size={bs}, ...) should hit {want}: at most "
                    f"({n} - 1) // {bs} = {(n - 1) // bs} blocks, as the last token is always "
                    f"computed (its logits give the next token); yours hits {got}"
                )


@LAB.check("lookup", points=2, timeout_s=20)
def match_agrees_with_the_reference_on_random_caches(sub):
    from hypothesis import strategies as st

    def run(example):
        stored, (tokens, salted), bs = example
        plants = [(p, range(10 * i, 10 * i + 10), KEY[s]) for i, (p, s) in enumerate(stored)]
        mine = ref.PrefixCache()  # hit ids depend on contents only, not on the serialisation
        for p in plants:
            plant(mine, p[0], bs, *p[1:])
        desc = "; ".join(f"{p}{' (salt t1)' if s else ''}" for p, s in stored) or "nothing"
        setup = f"with the full blocks of {desc} cached (block_size {bs}), "
        want = mine.match(tokens, bs, KEY[salted])[1]
        if (got := _match(sub, tokens, bs, plants, KEY[salted], setup)) != want:
            what = f"match({tokens}{', salt t1' if salted else ''})"
            raise CheckFailed(f"{setup}{what} should hit {want}; yours hits {got}")

    KEY = {False: E0, True: SALT1}
    prompt = st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=7), st.booleans())
    explore(st.tuples(st.lists(prompt, max_size=3), prompt, st.integers(1, 3)), run, 80)


# --- exercise "evict" -----------------------------------------------------------------------------
@LAB.check("evict", points=2, timeout_s=5)
def insert_keeps_the_first_block_under_a_hash(sub):
    cache, ops, want = sub.PrefixCache(), [], {}
    steps = [  # (block_hash, block_id, parent, tokens), what it returns, why
        ((H1, 3, ROOT, [1, 2]), True, "nothing is stored under H1 yet"),
        ((H1, 4, ROOT, [1, 2]), False, "H1 is taken: the first block stored under a hash keeps it"),
        ((H2, 3, H1, [3, 4]), False, "block 3 is indexed already, under H1"),
        ((H2, 5, H1, [3, 4]), True, "H2 and block 5 are both new"),
    ]
    for (h, b, parent, tokens), returns, why in steps:
        ops.append(f"insert({name(h)}, {b}, {name(parent)}, {tokens}, ...)")
        got, done = attempt("; ".join(ops), cache.insert, h, b, parent, tokens, E0), "; ".join(ops)
        if got is not returns:
            raise CheckFailed(f"{done} should return {returns} ({why}); yours returned {got!r:.40}")
        if returns:
            want[b] = (parent, tuple(tokens), E0, h)
        if contents(cache) != want or any(cache.hash_of(k) != v[3] for k, v in want.items()):
            shown = ", ".join(
                f"{name(h)}: CachedBlock({k}, {name(p)}, {t})" for k, (p, t, _, h) in want.items()
            )
            raise CheckFailed(
                f"after {done} the cache should hold {{{shown}}} (token_ids a tuple) and "
                f"hash_of(block) its hash; yours holds {_held(cache, sorted(want))}"
            )


@LAB.check("evict", points=2, timeout_s=5)
def evict_forgets_the_block_both_ways(sub):
    cache, ops = sub.PrefixCache(), []
    plant(cache, [1, 2, 3, 4], 2, [3, 5], sub=sub)
    for b, want, left in [(7, None, [3, 5]), (3, H1, [5]), (3, None, [5]), (5, H2, [])]:
        ops.append(f"evict({b})")
        got, done = attempt("; ".join(ops), cache.evict, b), "; ".join(ops)
        if got != want:
            why = "it is not cached" if want is None else f"its hash was {name(want)}"
            raise CheckFailed(
                f"{PLANTED}{done} should return {name(want)} ({why}); yours: {name(got)}"
            )
        if b == 3 and ref.PrefixCache.lookup(cache, H1, ROOT, [1, 2], E0) is not None:
            raise CheckFailed(
                f"{PLANTED}after {done}, lookup(H1, ...) still finds block 3: a stale hit (block "
                "3's slot is reused for other KV) -- delete its entry from self._by_hash too"
            )
        if sorted(contents(cache)) != left or cache.hash_of(b) is not None:
            raise CheckFailed(
                f"{PLANTED}after {done} the cache should index blocks {left}; yours holds "
                f"{_held(cache, [b])}"
            )


@LAB.check("evict", points=2, timeout_s=5)
def evicted_blocks_give_no_stale_hits(sub):
    kv = _Managers(sub, num_blocks=4)
    kv.call("add_sequence", "a", [1, 2, 3, 4, 5])  # [1, 2] and [3, 4] are cached
    kv.call("free_sequence", "a")  # ... and free: findable until their slots are reused
    kv.call("add_sequence", "b", [7] * 7)  # takes every block: a's are evicted, hold b's KV now
    kv.call("free_sequence", "b")
    kv.call("add_sequence", "c", [1, 2, 3, 4, 5])  # a's prefix is gone: nothing to reuse
    kv.call("add_sequence", "d", [7] * 6 + [9])  # ... but b's is there


@LAB.check("evict", points=1, timeout_s=5)
def cache_salts_keep_tenants_apart(sub):
    kv, prompt = _Managers(sub, num_blocks=12), [1, 2, 3, 4, 5]
    kv.call("add_sequence", "a", prompt, "t1")
    kv.call("add_sequence", "b", prompt, "t2")  # another tenant: no hit
    kv.call("add_sequence", "c", prompt, "t1")  # the same tenant: hits
    kv.call("add_sequence", "d", prompt)  # no salt: no hit either
    kv.call("free_sequence", "a")
    kv.call("free_sequence", "c")
    kv.call("add_sequence", "e", [1, 2, 3, 4, 9], "t1")  # free cached blocks come back


@LAB.check("evict", points=3, timeout_s=30)
def a_manager_on_your_prefix_cache_matches_the_reference(sub):
    from hypothesis import strategies as st

    def run(ops):
        kv, live, n = _Managers(sub, num_blocks=6), [], 0
        for op, *args in ops:
            if op == "add":
                seq, n = "abcdefghijklmnopqrstuvwxyz"[n % 26] + str(n // 26 or ""), n + 1
                kv.call("add_sequence", seq, *args)
                live += [seq] if seq in kv.ref else []  # else both ran out of blocks
            elif live and op == "append":
                kv.call("append_token", live[args[0] % len(live)], args[1])
            elif live:
                kv.call("free_sequence", live.pop(args[0] % len(live)))

    tokens = st.lists(st.integers(1, 3), min_size=1, max_size=7)
    op = st.one_of(
        st.tuples(st.just("add"), tokens) | st.tuples(st.just("add"), tokens, st.just("t1")),
        st.tuples(st.just("append"), st.integers(0, 3), st.integers(1, 3)),
        st.tuples(st.just("free"), st.integers(0, 3)),
    )
    explore(st.lists(op, min_size=1, max_size=14), run, 120)
