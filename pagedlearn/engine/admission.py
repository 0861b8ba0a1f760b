"""Admission: which requests the engine takes, checked once, at the door.

``LLMEngine.add_request`` hands every new request to :func:`admit` before anything is queued::

    request_id, prompt, params ──> tokenize ──> checks ──> Request (waiting, one sequence)
                                       │           │
                                       └───────────┴──> RequestRejectedError (nothing queued)

A request the engine could *never* serve is refused here, with an error that names the reason:

- its params are not :class:`SamplingParams` or :class:`BeamSearchParams`, or its id is in use;
- its prompt is neither text nor token ids, is empty, or holds an id outside the vocabulary;
- its prompt is longer than the model's positions (``max_model_len``);
- its prompt's blocks alone are more than the whole pool -- or, with ``kv_reservation="max"``,
  the blocks it reserves (:meth:`Scheduler.reserved_blocks`) are;
- its prompt is longer than one step's token budget and chunked prefill is off;
- it asks for more sequences (``n``) than a step may run (``max_num_seqs``).

Everything is checked here, once, so that the step itself checks nothing on its hot path
(DESIGN.md: validate once at the boundary a user calls).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pagedlearn.engine.request import Request, RequestMetrics
from pagedlearn.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedlearn.errors import PagedLearnError


class RequestRejectedError(PagedLearnError, ValueError):
    """A request the engine can never serve (too long for the model, the pool or the step)."""


def admit(
    engine,
    request_id: str | int,
    prompt: str | Sequence[int],
    params: SamplingParams | BeamSearchParams | None,
    arrival_index: int,
) -> Request:
    """A new waiting :class:`Request` for ``engine`` (an ``LLMEngine``), its one sequence holding
    the prompt; or :class:`RequestRejectedError` if it can never be served. Changes nothing:
    queueing the request is the engine's job."""
    rid = str(request_id)
    params = params if params is not None else SamplingParams()
    if not isinstance(params, (SamplingParams, BeamSearchParams)):
        raise RequestRejectedError(
            f"request {rid!r}: params must be SamplingParams or "
            f"BeamSearchParams, got {type(params).__name__}"
        )
    if rid in engine.requests:
        raise RequestRejectedError(f"request id {rid!r} is already in use")
    text = prompt if isinstance(prompt, str) else None
    token_ids = tokenize(engine, rid, prompt)
    why = _why_never(engine, len(token_ids), params)
    if why:
        raise RequestRejectedError(f"request {rid!r} rejected: {why}")
    generator = None
    if isinstance(params, SamplingParams) and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    req = Request(
        rid,
        text,
        token_ids,
        params,
        RequestMetrics(time.perf_counter()),
        arrival_index,
        generator=generator,
    )
    req.seqs.append(req.new_sequence(list(token_ids)))
    return req


def tokenize(engine, rid: str, prompt) -> list[int]:
    """The prompt's token ids: text goes through the tokenizer, token ids are checked against
    the model's vocabulary."""
    if isinstance(prompt, str):
        token_ids = list(engine.tokenizer.encode(prompt))
    else:
        try:
            token_ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestRejectedError(
                f"request {rid!r}: a prompt is a string or a list of token ids, got "
                f"{type(prompt).__name__}"
            ) from None
    if not token_ids:
        raise RequestRejectedError(f"request {rid!r} has an empty prompt")
    vocab = engine.model.config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestRejectedError(
            f"request {rid!r}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
        )
    return token_ids


def _why_never(engine, n: int, params: SamplingParams | BeamSearchParams) -> str | None:
    """Why a prompt of ``n`` tokens asking for ``params`` could never run, or None."""
    q, bs, pool = engine.scheduler, engine.kv.block_size, engine.kv.allocator.num_blocks
    if n > engine.max_model_len:
        return f"its prompt has {n} tokens, more than the model's {engine.max_model_len} positions"
    if (blocks := q.blocks_to_start(n)) > pool:
        return (
            f"its prompt needs {blocks} blocks of {bs} tokens, more than the whole pool of {pool}"
        )
    if (reserve := q.reserved_blocks(n, params)) > pool:
        return (
            f"kv_reservation='max' reserves {params.n} x blocks for min(prompt + max_tokens, "
            f"{engine.max_model_len}) = {reserve} blocks of {bs} tokens, more than the whole "
            f"pool of {pool}"
        )
    if n > q.max_num_batched_tokens and not q.chunked_prefill:
        return (
            f"its prompt has {n} tokens, more than max_num_batched_tokens="
            f"{q.max_num_batched_tokens} and enable_chunked_prefill=False"
        )
    if params.n > q.max_num_seqs:
        return f"it asks for {params.n} sequences, more than max_num_seqs={q.max_num_seqs}"
    return None
