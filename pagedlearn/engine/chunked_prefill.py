"""The step's token budget and chunked prefill: how much of a request fits in this step.

The scheduler (:mod:`pagedlearn.engine.scheduler`) decides *who* runs; these functions count
*how much*: whether a request fits the step's ``max_num_seqs`` and ``max_num_batched_tokens``
(:func:`fits_budgets`), how many of a waiting prompt's tokens its first chunk takes
(:func:`first_chunk`), how many prompt tokens a running request has left to prefill
(:func:`pending_prompt_tokens`), and the fewest blocks a request needs to make progress at all
(:func:`blocks_to_start`; admission.py refuses a prompt by :func:`prompt_blocks_to_start`).
They are separate because they are arithmetic on the budgets, not policy: the scheduler's
``_schedule_running``, ``_schedule_swapped`` and ``_schedule_waiting`` call them, and lab 6's
students, who write the policy, never need to open this file. ``s`` is the
:class:`~pagedlearn.engine.scheduler.Scheduler`, whose budgets they read.
"""

from __future__ import annotations

from pagedlearn.engine.readmission import readmission_blocks
from pagedlearn.engine.request import Request, RequestStatus
from pagedlearn.engine.scheduler_output import SchedulerOutput


def fits_budgets(s, req: Request, num_seqs: int, out: SchedulerOutput) -> bool:
    """Whether ``req`` (``num_seqs`` sequences) fits what this step has left of ``max_num_seqs``
    and of the token budget: a swapped request needs one token per sequence, a waiting one
    with chunked prefill any first chunk, and without it its whole prompt -- unless nothing
    else is scheduled (a prompt longer than the budget still runs alone in a step)."""
    seqs_now = sum(len(r.seqs) for r in s.running)
    if seqs_now + num_seqs > s.max_num_seqs:
        return False
    left = s.max_num_batched_tokens - out.num_batched_tokens
    if req.status is not RequestStatus.WAITING:  # swapped: one token per sequence
        return len(req.seqs) <= left
    if s.chunked_prefill and len(req.seqs) == 1:  # a first chunk of any size will do
        return left >= 1
    # A prompt longer than the budget still runs when it is alone in the step.
    return not out.scheduled or sum(len(q.token_ids) for q in req.seqs) <= left


def first_chunk(s, req: Request, out: SchedulerOutput) -> int:
    """How many of a waiting request's first tokens to admit this step: all of them, or
    with chunking, its cached prefix (free) plus what the step's token budget has left."""
    tokens = req.seqs[0].token_ids
    if not s.chunked_prefill or len(req.seqs) > 1:
        return len(tokens)
    left = s.max_num_batched_tokens - out.num_batched_tokens
    if len(tokens) <= left:  # all of it fits: no need to hash it for the cache lookup
        return len(tokens)
    cached = s.kv.cached_prefix_tokens(tokens, req.cache_salt, req.adapter_id)
    return min(len(tokens), cached + left)


def prompt_blocks_to_start(s, num_tokens: int) -> int:
    """The fewest blocks one sequence of ``num_tokens`` tokens needs to make progress: all
    its blocks, or with chunked prefill its first chunk's -- and, where a sliding window
    bounds what the sequence holds, no fewer than that (``min_blocks_to_run``). Admission
    refuses a prompt by this number too."""
    kv = s.kv
    if not s.chunked_prefill:
        return kv.blocks_needed(num_tokens)
    chunk = kv.blocks_needed(min(num_tokens, s.max_num_batched_tokens))
    return max(kv.min_blocks_to_run(num_tokens), chunk)


def blocks_to_start(s, req: Request) -> int:
    """:func:`prompt_blocks_to_start` for a waiting request; several sequences (re-admitted
    after a recompute) are prefilled whole, sharing their common prefixes (readmission.py)."""
    if len(req.seqs) > 1:
        return readmission_blocks(s.kv, req.seqs)
    return prompt_blocks_to_start(s, len(req.seqs[0].token_ids))


def pending_prompt_tokens(kv, req: Request) -> int:
    """Prompt tokens a running request has yet to prefill in chunks (0: it is decoding)."""
    if len(req.seqs) != 1:  # forked samples and beams are past their prompt
        return 0
    pending = len(req.seqs[0].token_ids) - kv.num_tokens(req.seqs[0].seq_id)
    return pending if pending > 1 else 0
