"""What may share cached KV: the model's version in every block hash, and forgetting every prefix.

A prompt hits a cached block only if everything that went into the block's hash agrees
(core/prefix_cache.py): its tokens and those before them, and the *extra keys* -- the model, the
LoRA adapter and the cache salt (``LLMEngine.add_request``'s ``cache_salt`` and
``lora_request``, admission.py). The model's key is the manager's ``model_id``: the model's name,
or ``(name, version)`` once :attr:`LLMEngine.model_version` is set. This file holds the two ways
an operator changes what may be shared after the weights change (vLLM's
``LLM.reset_prefix_cache`` is meant for that moment):

- :func:`set_model_version` -- a new key: no later prompt hits a block cached under the old one,
  and the old blocks are evicted as the pool needs them;
- :func:`reset` -- drop every cached prefix now.

They live beside the engine (``LLMEngine.model_version``, ``LLMEngine.reset_prefix_cache`` call
them) because both need the scheduler's queues, which the manager does not know.
"""

from __future__ import annotations

from collections.abc import Hashable

from pagedlearn.errors import PagedLearnError


def set_model_version(engine, version: Hashable) -> None:
    """Put ``version`` into every block hash from now on: the manager's ``model_id`` becomes
    ``(model name, version)``, or the bare name for None. Running sequences keep the keys they
    started with (their blocks are cached under the old one, which no new prompt looks up); a
    request preempted by recompute is re-admitted under the new one. Old cached blocks are
    evicted as the pool needs them (or at once: :func:`reset`)."""
    # It enters every block hash by its text (repr): only values whose text is their content.
    textual = isinstance(version, (str, int)) and not isinstance(version, bool)
    if version is not None and not textual:
        raise PagedLearnError(
            f"model_version must be hashable as text: a str, an int or None, got {version!r}"
        )
    name = engine.model_name
    engine.kv.model_id = name if version is None else (name, version)
    engine._model_version = version


def reset(engine) -> int:
    """Forget every cached prefix: afterwards no prompt hits a block cached before. Returns how
    many cached blocks were dropped (vLLM returns a bool instead). The manager's ``cache_reset``
    event lets the views mark it.

    Refused (:class:`PagedLearnError`, nothing changed) while a request holds blocks -- running
    or swapped out --, naming them: finish or abort them first. Waiting requests hold none, and
    stay queued."""
    if engine.broken:
        raise PagedLearnError(f"reset_prefix_cache refused: {engine.broken}")
    q = engine.scheduler
    held = [(r.request_id, "running") for r in q.running]
    held += [(r.request_id, "swapped") for r in q.swapped]
    if held:
        names = ", ".join(f"{rid!r} ({status})" for rid, status in held[:8])
        more = f" and {len(held) - 8} more" if len(held) > 8 else ""
        raise PagedLearnError(
            f"reset_prefix_cache refused: requests {names}{more} hold blocks; wait until "
            "they finish (or abort them) first"
        )
    return engine.kv.reset_prefix_cache()
