"""Max-length reservation: the baseline the paper compares paging against, as a scheduler policy.

Under **paging** (``kv_reservation="paged"``, vLLM) a request takes a block when a token needs
one, and promises nothing ahead: admission looks only at the free blocks now (and a watermark),
and a running request that runs short is preempted.

Under **max-length reservation** (``kv_reservation="max"``) the scheduler behaves like Orca (Max)
in the paper's section 2.3. A waiting request is admitted only if the pool can hold, for each of
its ``n`` sequences (samples or beams: no sharing assumed), the blocks of ``prompt + max_tokens``
tokens (capped at the model's length), *on top of* what every running request's reservation has
not allocated yet; those blocks stay promised to it until it finishes. Blocks are still allocated
one at a time by the same manager, so the model and the attention read exactly the same block
tables -- but since every block a request can ever need is set aside, a running request never
has to be preempted. It reserves *blocks*, not one contiguous run of memory, so it has no
external fragmentation (the simulator's buddy-allocator baselines in
:mod:`pagedlearn.sim.simulator` model that): an optimistic upper bound for a reservation system.

:class:`KVReservation` answers the scheduler's two questions -- how many blocks a request
reserves, and how many free blocks nobody has been promised -- for either setting.
"""

from __future__ import annotations

from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine.request import Request
from pagedlearn.errors import PagedLearnError

KV_RESERVATIONS = ("paged", "max")  # paging (vLLM) or max-length reservation (Orca (Max))


class KVReservation:
    """The blocks promised to requests under ``mode`` ("paged": none; "max": see the module
    docstring), over the pool of ``kv``; ``max_model_len`` caps a sequence's length.

    >>> from pagedlearn.engine.sampling_params import SamplingParams
    >>> r = KVReservation(KVCacheManager(num_blocks=16, block_size=4), "max", max_model_len=20)
    >>> r.reserved_blocks(6, SamplingParams(max_tokens=5))  # 11 tokens: 3 blocks
    3
    >>> r.reserved_blocks(6, SamplingParams(max_tokens=100, n=2))  # capped at 20 tokens, twice
    10
    """

    def __init__(
        self, kv: KVCacheManager, mode: str = "paged", max_model_len: int | None = None
    ) -> None:
        if mode not in KV_RESERVATIONS:
            raise PagedLearnError(f"kv_reservation must be one of {KV_RESERVATIONS}, got {mode!r}")
        self.kv, self.mode, self.max_model_len = kv, mode, max_model_len

    def reserved_blocks(self, num_prompt_tokens: int, params) -> int:
        """Blocks a request reserves for its whole life under ``"max"``: for each of its
        ``params.n`` sequences, the blocks of ``prompt + max_tokens`` tokens, capped at the
        model's length (0 under paging, which reserves nothing)."""
        if self.mode != "max":
            return 0
        tokens = num_prompt_tokens + params.max_tokens
        if self.max_model_len is not None:
            tokens = min(tokens, self.max_model_len)
        return params.n * self.kv.blocks_needed(tokens)  # every KV-cache group's blocks

    def reservation_of(self, req: Request) -> int:
        return self.reserved_blocks(len(req.prompt_token_ids), req.params)

    def unreserved_blocks(self, running: list[Request]) -> int:
        """Free blocks that no request in ``running`` has been promised: the pool's free blocks
        minus, for each running request, its reservation less the distinct blocks it holds now
        (a copy-on-write copy adds a block without growing a block table, so count blocks, not
        table entries). A prefix-cache block shared by two requests counts for both; the
        scheduler's preemption path stays as a safety net. Under paging: just the free blocks."""
        owed = 0
        for r in running:
            held = {
                b
                for s in r.seqs
                if s.seq_id in self.kv
                for table in self.kv.block_tables(s.seq_id)
                for b in table
                if b >= 0  # a sliding window's freed entries hold no block
            }
            owed += max(0, self.reservation_of(r) - len(held))
        return self.kv.num_free_blocks - owed

    def fits(self, req: Request, running: list[Request]) -> bool:
        """Can ``req``'s whole reservation be set aside now, beside ``running``'s? (Always
        under paging: admission there is the scheduler's block budget, ``_can_admit``.)"""
        if self.mode != "max":
            return True
        return self.reservation_of(req) <= self.unreserved_blocks(running)
