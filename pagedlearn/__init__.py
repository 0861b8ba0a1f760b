"""pagedlearn: PagedAttention (Kwon et al., SOSP 2023 -- the idea behind vLLM), small and readable.

Read in this order: ``block_allocator`` (physical blocks, refcounts, free queue), ``block_table``
(logical -> physical, slots), ``prefix_cache`` (hash chain over full blocks), ``kv_cache_manager``
(all of it together: add / append / fork with copy-on-write / free), ``trace`` (every block event).

The package imports only the standard library at load time; torch, Triton and transformers are
imported by the parts that need them.
"""

from pagedlearn.block_allocator import BlockAllocator
from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.kv_cache_manager import KVCacheManager

__version__ = "0.1.0"

__all__ = ["BlockAllocator", "KVCacheManager", "OutOfBlocksError", "PagedLearnError"]
