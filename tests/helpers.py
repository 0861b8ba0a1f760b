"""Helpers shared by the tests (imported as ``from helpers import ...``)."""

from pagedlearn import KVCacheManager


def snapshot(kv: KVCacheManager):
    """Everything an operation could change, to check that a failed one changed nothing."""
    a = kv.allocator
    cache = sorted((h, e) for h, e in kv.prefix_cache.items()) if kv.prefix_cache else []
    return (
        {s: (kv.block_table(s), kv.token_ids(s)) for s in kv.sequences()},
        [a.refcount(b) for b in range(a.num_blocks)],
        a.free_queue(),
        [b for b in range(a.num_blocks) if a.is_cached(b)],
        cache,
        list(kv._copies),
        a.num_evictions,
    )
