"""Hybrid models: several KV-cache groups over one block pool (vLLM v1's hybrid allocator).

A model that mixes sliding-window and full-attention layers (Mistral's window, Gemma 3's five
local layers to one global) keeps one block table per *group* of layers with the same attention:

- ``kv_cache_groups.py`` -- which layers form a group, and what each group's block holds.
- ``sliding_window_manager.py`` -- a group's manager that frees the blocks its window has left
  behind (``remove_skipped_blocks``).
- ``kv_cache_coordinator.py`` -- one manager per group over one shared pool, behind the same
  interface as :class:`~pagedlearn.core.kv_cache_manager.KVCacheManager`.
"""
