"""``python -m pagedlearn blocks``: the memory manager at work, in text, with no model.

A small pool serves a few sequences the way an engine would: two requests share a system prompt
(prefix-cache hit), one request samples two continuations (fork, then copy-on-write), all of them
grow token by token, some finish (their blocks go back, cached ones stay findable), and a late
request reuses the cached prefix. After each phase it prints every block table and a map of the
physical pool. No model runs: token ids are made up, so every step is the manager alone.
(``python -m pagedlearn demo`` runs the same machinery under a real model.)
"""

from __future__ import annotations

from collections import Counter

from pagedlearn.core.kv_cache_manager import KVCacheManager

SYSTEM_PROMPT = list(range(100, 108))  # 8 made-up token ids every request starts with
C_DECODES = 28  # tokens C generates: its 13-token prompt grows to 41, the walk's longest sequence
# The command line's bounds: a pool map of more blocks does not fit a screen (it is printed five
# times), and a block of more than 41 tokens never fills in this walk.
MAX_NUM_BLOCKS = 1024
MAX_BLOCK_SIZE = 64


def format_pool(
    kv: KVCacheManager, labels: dict | None = None, per_row: int = 4, width: int = 14
) -> str:
    """One cell per physical block: its owners (``labels`` may shorten their ids), ``xN`` for
    the refcount of a shared block, ``c`` for cached-free (free, but holding a findable prefix),
    ``.`` for empty. (``python -m pagedlearn demo`` draws the engine's pool with it too.) With
    several KV-cache groups (a sliding-window model), an owner is ``A/F`` or ``A/S``: request A's
    block in the full or the sliding group (:func:`group_tags`)."""
    a, labels = kv.allocator, labels or {}
    tags = group_tags(kv)
    owners: dict[int, list[str]] = {}
    for seq_id in kv.sequences():
        for tag, table in zip(tags, kv.block_tables(seq_id), strict=True):
            for b in table:
                if b >= 0:  # -1: a block a sliding window freed
                    owners.setdefault(b, []).append(labels.get(seq_id, str(seq_id)) + tag)
    cells = []
    for b in range(a.num_blocks):
        if b in owners:
            cell = "+".join(owners[b]) + (f" x{a.refcount(b)}" if a.refcount(b) > 1 else "")
        else:
            cell = "c" if a.is_cached(b) else "."
        cells.append(f"{b:>3}: {cell:<{width}}")
    rows = [" ".join(cells[i : i + per_row]).rstrip() for i in range(0, len(cells), per_row)]
    return "\n".join(rows)


def group_tags(kv: KVCacheManager) -> list[str]:
    """The suffix of each KV-cache group's owners in :func:`format_pool`: ``[""]`` for one
    group; ``"/F"`` for full attention and ``"/S"`` (``"/S1"``, ... if several) for sliding."""
    groups = getattr(kv, "groups", None)
    if not groups or len(groups) == 1:
        return [""]
    sliding = [g for g in groups if g.is_sliding]
    return [
        "/F" if not g.is_sliding else "/S" + (str(sliding.index(g)) if len(sliding) > 1 else "")
        for g in groups
    ]


def show(kv: KVCacheManager, title: str) -> None:
    print(f"\n== {title}")
    for seq_id in kv.sequences():
        toks = kv.token_ids(seq_id)
        print(f"  {seq_id!s:<4} {len(toks):>3} tokens  block table {kv.block_table(seq_id)}")
    print(format_pool(kv))
    s = kv.stats()
    print(
        f"  used {s['used_blocks']}, free {s['free_blocks']} (cached {s['cached_blocks']}), "
        f"shared {s['shared_blocks']}, CoW copies {s['cow_copies']}, prefix hits "
        f"{s['prefix_hit_tokens']}/{s['prefix_query_tokens']} tokens, "
        f"evictions {s['evictions']}"
    )
    kv.check_invariants()


def run_demo(num_blocks: int = 16, block_size: int = 4, prefix_caching: bool = True) -> None:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    log = kv.record()
    print(
        f"pool: {num_blocks} blocks x {block_size} tokens, prefix caching "
        f"{'on' if prefix_caching else 'off'}\n"
        "(in the pool maps: A+B x2 = a block shared by A and B, refcount 2; c = free but cached; "
        ". = empty)"
    )

    reused = kv.add_sequence("A", [*SYSTEM_PROMPT, 1, 2, 3])
    print(f"A: prompt of {len(SYSTEM_PROMPT) + 3} tokens, {reused} reused")
    reused = kv.add_sequence("B", [*SYSTEM_PROMPT, 7, 7])
    print(f"B: same system prompt, {reused} tokens reused from A's blocks")
    show(kv, "two prompts admitted")

    kv.fork("A", "A2")  # parallel sampling: a second continuation of A's prompt
    for step in range(6):
        for seq_id in kv.sequences():
            kv.append_token(seq_id, 200 + step + (50 if seq_id == "A2" else 0))
        for src, dst in kv.pop_copies():
            print(f"  step {step}: copy-on-write, copy block {src} -> block {dst}")
    show(kv, "A forked into A2, six decode steps")

    kv.free_sequence("A")
    kv.free_sequence("B")
    show(kv, "A and B finished (their full blocks stay cached)")

    reused = kv.add_sequence("C", [*SYSTEM_PROMPT, 9, 9, 9, 9, 9])
    print(f"C: arrives later with the system prompt, {reused} tokens reused from the cache")
    evictions = kv.stats()["evictions"]
    for step in range(C_DECODES):
        kv.append_token("C", 300 + step)
    if kv.stats()["evictions"] > evictions:
        why = "the empty blocks ran out, so least recently used cached blocks were evicted"
    else:
        why = "the pool still had empty blocks, so no cached block was evicted"
    show(kv, f"C decoded {C_DECODES} tokens: {why}")

    for seq_id in kv.sequences():
        kv.free_sequence(seq_id)
    show(kv, "everything finished")
    counts = Counter(e.kind for e in log.events)
    print(
        f"\n{len(log)} block events recorded: "
        + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
    )
