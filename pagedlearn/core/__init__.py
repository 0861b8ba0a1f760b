"""The core: PagedAttention's memory manager, to read first (the paper's sections 4.2-4.5).

It never touches a tensor: it hands out block ids, counts who shares them, and says where each
token's K/V goes and which blocks must be copied. Read in this order:

1. ``block_allocator.py`` -- the physical blocks: a free queue, a refcount per block, lazy LRU
   eviction of free blocks that still hold a cached prefix.
2. ``block_table.py`` -- one sequence's logical -> physical map and its slots
   (``slot = block_id * block_size + offset``).
3. ``prefix_cache.py`` -- full blocks found again by a hash chained on the parent block.
4. ``sequence_tables.py`` -- every sequence's table, on the GPU or swapped out, and the checks of
   what a caller hands in.
5. ``swap.py`` -- preemption by swapping: a request's blocks to a CPU pool and back (section 4.5).
6. ``kv_cache_pool.py`` -- what a manager allocates from: the blocks, the prefix cache, the swap
   space, the pending copies and the trace, in one object.
7. ``kv_cache_manager.py`` -- all of it together: add / append / fork with copy-on-write / free.
8. ``kv_cache_queries.py`` -- the manager's read-only questions: block tables, slot mappings,
   sizes, stats, the trace.
9. ``invariants.py`` -- the rules that hold after every operation, each checked by number.

After the core: ``engine/`` (the scheduler and ``LLM``: a model generating from this cache),
``models/`` (the cache plugged into Hugging Face models), ``attention/`` and ``kernels/`` (what
the block tables are for). ``hybrid/`` runs one manager per KV-cache group for models that mix
sliding-window and full attention; ``trace/`` records every block event the manager emits.
"""
