"""Helpers shared by the tests (imported as ``from helpers import ...``)."""

from pagedlearn import KVCacheManager
from pagedlearn.trace import PoolReplay


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
        a.num_shared_blocks,
    )


def replay_matches(kv: KVCacheManager, state: PoolReplay) -> bool:
    """Whether a pool rebuilt from events equals the manager's real pool."""
    a = kv.allocator
    cached = {b: kv.prefix_cache.hash_of(b).hex() for b in range(a.num_blocks) if a.is_cached(b)}
    return (
        state.refcounts == [a.refcount(b) for b in range(a.num_blocks)]
        and state.tables == {s: kv.block_table(s) for s in kv.sequences()}
        and state.cached == cached
    )
