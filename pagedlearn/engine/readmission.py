"""Re-admitting a request preempted by recompute: its sequences share their prefix again.

A request with several sequences -- ``n`` parallel samples, or beams -- shares its prompt's blocks
through ``fork`` while it runs (copy-on-write). A recompute preemption frees every block, so when
the request is admitted again each sequence must be prefilled anew. Prefilled independently,
``n`` samples of a 1,000-token prompt would hold ``n`` copies of its KV: the request's memory
would grow ``n``-fold just because it was preempted (with prefix caching the copies would be
found in the cache, but without it nothing else brings them back together).

So the scheduler re-admits a request's sequences as they were built: the first is prefilled
(reusing whatever the prefix cache still holds), and each later one shares the whole blocks of
its longest common prefix with an earlier sibling (``KVCacheManager.fork_prefix``) and prefills
only the rest -- by sharing, not by looking the sibling's blocks up in the cache, so that it
holds even when a group's allocation evicts a cache entry. Beams that had shared more
than the prompt -- a common ancestor's tokens -- share that much again. Only whole blocks are
shared (a shared partly filled block would be copied on write before the forward pass fills
it), and never a sequence's last token: it must be computed to give the logits of its next one.
The forward pass writes the first sequence's K/V before any query of that layer reads it
(models/paged_attention.py), so a sibling reads its shared blocks in the same step.

>>> from types import SimpleNamespace as S
>>> seqs = [S(token_ids=[1, 2, 3, 4, 5, 6]), S(token_ids=[1, 2, 3, 4, 5, 7]), S(token_ids=[9])]
>>> share_plan(seqs, block_size=2)    # (the earlier sibling to share with, tokens shared)
[(None, 0), (0, 4), (None, 0)]
"""

from __future__ import annotations

from collections.abc import Sequence


def share_plan(seqs: Sequence, block_size: int) -> list[tuple[int | None, int]]:
    """For each sequence (anything with ``token_ids``), in order: the index of the earlier
    sequence it shares its longest common prefix with, and how many tokens it shares -- whole
    blocks, fewer than all its tokens; ``(None, 0)`` when it shares no whole block."""
    plan: list[tuple[int | None, int]] = [(None, 0)] * min(len(seqs), 1)
    for i in range(1, len(seqs)):
        tokens = seqs[i].token_ids
        best, longest = None, 0
        for j in range(i):
            n = _common_prefix(tokens, seqs[j].token_ids)
            if n > longest:
                best, longest = j, n
        shared = min(longest, len(tokens) - 1) // block_size * block_size
        plan.append((best, shared) if shared else (None, 0))
    return plan


def readmission_blocks(kv, seqs: Sequence) -> int:
    """The most blocks that re-admitting ``seqs`` together may take: each shares with its
    sibling as :func:`share_plan` says (in every KV-cache group: ``kv.blocks_needed`` counts
    them all); the first one's prefix-cache hits can only lower that. One exception counts
    every sequence whole: a sliding window with prefix caching, where the first sequence's
    cache hits may leave it with freed (null) entries that a sibling still reads -- that
    sibling then cannot share and is prefilled whole (``fork_prefix`` refuses it)."""
    if kv.has_sliding_window and kv.prefix_cache is not None:
        return sum(kv.blocks_needed(len(s.token_ids)) for s in seqs)
    plan = share_plan(seqs, kv.block_size)
    return sum(
        kv.blocks_needed(len(s.token_ids)) - kv.blocks_needed(shared)
        for s, (_, shared) in zip(seqs, plan, strict=True)
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # up to the shorter one
        if x != y:
            break
        n += 1
    return n
