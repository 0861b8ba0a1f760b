"""Admission: which requests the engine takes, checked once, at the door.

``LLMEngine.add_request`` hands every new request to :func:`admit` before anything is queued::

    request_id, prompt, params, cache_salt, lora_request
        ──> prompt shape ──> tokenize ──> checks ──> Request (waiting, one sequence)
                 │               │           │
                 └───────────────┴───────────┴──> RequestRejectedError (nothing queued)

A prompt comes in vLLM's shapes: text, a list of token ids, or a dict -- ``{"prompt": text}``
(vLLM's ``TextPrompt``) or ``{"prompt_token_ids": [...]}`` (``TokensPrompt``) -- with an
optional ``"cache_salt"``. Two more things go into every block hash (prefix_cache.py's extra
keys), so that requests share cached KV only when they agree on them:

- ``cache_salt`` (in the dict, or ``add_request``'s argument; any hashable): one tenant's
  prompts never hit blocks that another tenant's computed, so it cannot learn what others sent
  by timing cache hits;
- ``lora_request``: the LoRA adapter, as an id (str or int) or an object with ``lora_int_id``
  / ``lora_name`` (vLLM's ``LoRARequest``). pagedlearn applies no adapter: it only keeps each
  adapter's KV apart, as vLLM must (the same tokens give other KV under another adapter).

A request the engine could *never* serve is refused here, with an error that names the reason:

- its params are not :class:`SamplingParams` or :class:`BeamSearchParams`, or its id is in use;
- its prompt is neither text nor token ids nor such a dict (unknown keys, both ``"prompt"`` and
  ``"prompt_token_ids"`` or neither), is empty, or holds an id outside the vocabulary;
- its cache salt or adapter id is not hashable, or the dict's salt and ``cache_salt`` differ;
- its prompt is longer than the model's positions (``max_model_len``);
- its prompt's blocks alone are more than the whole pool -- or, with ``kv_reservation="max"``,
  the blocks it reserves (:meth:`Scheduler.reserved_blocks`) are;
- its prompt is longer than one step's token budget and chunked prefill is off;
- it asks for more sequences (``n``) than a step may run (``max_num_seqs``).

Everything is checked here, once, so that the step itself checks nothing on its hot path
(DESIGN.md: validate once at the boundary a user calls).

>>> parse_prompt("r", {"prompt_token_ids": [72, 105], "cache_salt": "tenant-a"})
([72, 105], 'tenant-a')
>>> try:
...     parse_prompt("r", {"prompt": "Hi", "prompt_token_ids": [72]})
... except RequestRejectedError as e:
...     print(e)
request 'r': a dict prompt has "prompt" (text) or "prompt_token_ids", not both
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Hashable, Sequence

import torch

from pagedlearn.engine.chunked_prefill import prompt_blocks_to_start
from pagedlearn.engine.request import Request, RequestMetrics
from pagedlearn.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedlearn.errors import PagedLearnError


class RequestRejectedError(PagedLearnError, ValueError):
    """A request the engine can never serve (too long for the model, the pool or the step)."""


PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")  # vLLM's TextPrompt / TokensPrompt


def admit(
    engine,
    request_id: str | int,
    prompt: str | Sequence[int] | dict,
    params: SamplingParams | BeamSearchParams | None,
    arrival_index: int,
    cache_salt: Hashable = None,
    lora_request=None,
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
    prompt, cache_salt = parse_prompt(rid, prompt, cache_salt)
    adapter_id = adapter_id_of(rid, lora_request)
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
        cache_salt=cache_salt,
        adapter_id=adapter_id,
    )
    req.seqs.append(req.new_sequence(list(token_ids)))
    return req


def parse_prompt(rid: str, prompt, cache_salt: Hashable = None) -> tuple:
    """A prompt in any of vLLM's shapes as ``(text or token ids, cache salt)``: a dict gives
    its ``"prompt"`` or ``"prompt_token_ids"``, and its ``"cache_salt"`` unless ``cache_salt``
    (``add_request``'s) is given too -- then the two must be equal."""
    if isinstance(prompt, dict):
        unknown = [k for k in prompt if k not in PROMPT_KEYS]
        if unknown:
            raise RequestRejectedError(
                f"request {rid!r}: unknown prompt key(s) {', '.join(map(repr, unknown))}; a "
                'dict prompt has "prompt" (text) or "prompt_token_ids", and may have '
                '"cache_salt"'
            )
        text, ids = "prompt" in prompt, "prompt_token_ids" in prompt
        if text == ids:
            raise RequestRejectedError(
                f'request {rid!r}: a dict prompt has "prompt" (text) or "prompt_token_ids", '
                f"{'not both' if text else 'and this one has neither'}"
            )
        salt = _hashable(rid, "cache_salt", prompt.get("cache_salt"))
        _hashable(rid, "cache_salt", cache_salt)
        if salt is not None and cache_salt is not None and salt != cache_salt:
            raise RequestRejectedError(
                f'request {rid!r}: its prompt\'s "cache_salt" ({salt!r}) and cache_salt= '
                f"({cache_salt!r}) differ; give one"
            )
        cache_salt = salt if cache_salt is None else cache_salt
        prompt = prompt["prompt"] if text else prompt["prompt_token_ids"]
        if text != isinstance(prompt, str):
            raise RequestRejectedError(
                f'request {rid!r}: "prompt" is text and "prompt_token_ids" a list of token '
                f"ids; got {'prompt' if text else 'prompt_token_ids'}="
                f"{type(prompt).__name__}"
            )
    return prompt, _hashable(rid, "cache_salt", cache_salt)


def adapter_id_of(rid: str, lora_request) -> Hashable:
    """The adapter id that goes into the block hashes: ``lora_request`` itself (a str or int
    id), or the ``lora_int_id`` (else ``lora_name``) of vLLM's ``LoRARequest`` shape."""
    for attr in ("lora_int_id", "lora_name"):
        if getattr(lora_request, attr, None) is not None:
            return _hashable(rid, f"lora_request.{attr}", getattr(lora_request, attr))
    return _hashable(rid, "lora_request", lora_request)


def _hashable(rid: str, what: str, value):
    """``value``, if it may be a key of the block hashes (None: no key), else rejected. A key
    enters the hash by its text (``repr``, prefix_cache.py), so only values whose text is
    their content are taken: a str or an int (vLLM's salts are strings, its adapter ids ints)."""
    if value is not None and (not isinstance(value, (str, int)) or isinstance(value, bool)):
        raise RequestRejectedError(
            f"request {rid!r}: {what} must be hashable as text: a str or an int, got "
            f"{type(value).__name__} {reprlib.repr(value)}"
        )
    return value


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
                f"request {rid!r}: a prompt is a string, a list of token ids, or a dict "
                f'{{"prompt": ...}} / {{"prompt_token_ids": [...]}}, got {type(prompt).__name__}'
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
    if (blocks := prompt_blocks_to_start(q, n)) > pool:
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
