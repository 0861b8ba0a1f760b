"""Simulations that recompute the PagedAttention paper's memory results with pagedlearn's own
allocator (Kwon et al., SOSP 2023, arXiv 2309.06180). ``python -m pagedlearn paper`` runs them.

Read in this order:

- ``workloads``: request streams (ShareGPT-like, Alpaca-like, a mixed "home server", multi-turn
  chats), with the distribution choices stated up front.
- ``buddy``: the contiguous-reservation baselines' memory: a buddy allocator over token slots.
- ``simulator``: an iteration-level serving loop over either memory model: contiguous reservation
  (Orca Max / Pow2 / Oracle) on the buddy allocator, or paging on the real ``KVCacheManager``.
- ``paper``: Figures 2, 13 and 18b (memory side), and the spread sensitivity, beside the paper.
- ``sharing``: Figure 15, parallel sampling and beam search as forked sequences.
- ``prefix``: prefix caching on shared system prompts and multi-turn chats, cold and warm.
- ``swap_recompute``, ``serving_latency``: measured on the real engine, not simulated: Figure 19
  (swap vs recompute) and Figure 12 (normalized latency against request rate).
- ``plots``: one matplotlib figure per experiment (``figures/``).
"""
