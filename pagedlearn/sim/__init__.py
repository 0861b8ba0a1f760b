"""Simulations that recompute the PagedAttention paper's memory results with pagedlearn's own
allocator (Kwon et al., SOSP 2023, arXiv 2309.06180).

- ``workloads``: request-length samplers (ShareGPT-like, Alpaca-like, a mixed "home server").
- ``buddy``: the contiguous-reservation baseline's memory: a buddy allocator over token slots.
- ``simulator``: an iteration-level serving loop over either memory model: contiguous reservation
  (Orca Max / Pow2 / Oracle) on the buddy allocator, or paging on the real ``KVCacheManager``.
"""
