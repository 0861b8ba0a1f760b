"""The checks a request body gets beyond its types (protocol.py holds the bodies' types): text
that UTF-8 can hold, token ids inside the vocabulary, vLLM's rule for ``cache_salt``, a prompt
short enough to tokenize, ``max_tokens`` that fits the context, and samples the block pool could
hold at once. Each raises :class:`ProtocolError` naming the field, which the server answers with
OpenAI's error shape (a 400 unless ``status`` says otherwise)."""

from __future__ import annotations

import re

from pagedlearn.engine.sampling_params import SamplingParams
from pagedlearn.errors import PagedLearnError
from pagedlearn.serve.middleware import preview


class ProtocolError(PagedLearnError, ValueError):
    """A request body the server refuses (HTTP 400 unless ``status`` says otherwise); ``param``
    names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_text(text: str, field: str) -> str:
    """``text``, if it can be written as UTF-8: a JSON string may escape a lone surrogate
    (``"\\ud800"``), which Python keeps and no tokenizer can encode. (A search, not an
    ``encode``: a 50 MB prompt is not copied to be checked.)"""
    if bad := _SURROGATE.search(text):
        raise ProtocolError(
            f"{field} is not valid Unicode: it holds a lone surrogate ({bad.group()!r}) at "
            f"character {bad.start()}; a \\ud800-\\udfff escape in JSON must be one of a pair",
            field,
        )
    return text


def check_token_ids(ids, vocab_size: int | None, field: str) -> None:
    """Refuse a token id at or above ``vocab_size`` (None: not checked; below 0 is refused by
    the type, :data:`TokenId`): the engine would index its embedding with it, or wait for a
    token the model can never sample."""
    if vocab_size is None:
        return
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise ProtocolError(
                f"{field}.{i} is {preview(t)}, outside the vocabulary (0..{vocab_size - 1})",
                field,  # (the message says which one)
            )


def bad_token_id(value) -> str:
    """What is wrong in a prompt that is a list but not of token ids: its first item that is
    not an int >= 0 (a bool is not an int, nor is 1.0), in words for the 400 (or "")."""
    if not isinstance(value, list) or any(isinstance(v, (str, list)) for v in value):
        return ""
    for i, v in enumerate(value):
        if type(v) is not int or v < 0:
            return f" (item {i} is {preview(v)})"
    return ""


MAX_CACHE_SALT_LENGTH = 128  # vLLM's
CACHE_SALT_FORBIDDEN = "@/\\\0"


def check_cache_salt(salt: str | None) -> None:
    """vLLM's rule (``validate_cache_salt``) and wording: None, or a non-empty str of at most
    128 characters without '@', '/', '\\' or NUL. The salt goes into every block hash of the
    request (prefix_cache.py), so a long one would be kept in the cache's keys."""
    if salt is None:
        return
    if not salt:
        raise ProtocolError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > MAX_CACHE_SALT_LENGTH or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        raise ProtocolError(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


# A prompt of more characters than its context's tokens could ever stand for is refused before
# it is tokenized (seconds, for a prompt near the body limit); the margin covers a normalizer
# that makes text shorter before it is split (models/tokenizer.py, max_chars_per_token).
PROMPT_CHARS_MARGIN = 2


def check_prompt_chars(
    chars: int, max_model_len: int, chars_per_token: int | None, field: str = "prompt"
) -> None:
    """Refuse a prompt of ``chars`` characters that cannot fit ``max_model_len`` tokens, when
    one token stands for at most ``chars_per_token`` characters (None: unknown, no check)."""
    if chars_per_token is None:
        return
    most = max_model_len * chars_per_token * PROMPT_CHARS_MARGIN
    if chars > most:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt is {chars} characters long, more than {max_model_len} tokens of this "
            f"tokenizer can hold (at most {most} characters; it was not tokenized). Please "
            "reduce the length of the input prompt.",
            field,
        )


def resolve_max_tokens(
    max_tokens: int | None,
    prompt_len: int,
    max_model_len: int,
    field: str = "max_tokens",
    prompt_field: str = "prompt",
) -> int:
    """``max_tokens`` checked against the context ``max_model_len``; None: the rest of it.

    The prompt alone first (vLLM's wording). Then the prompt plus ``max_tokens``: where vLLM 0.33
    shortens ``max_tokens`` to what the context has left (``get_max_tokens`` in
    ``entrypoints/serve/utils/api_utils.py``; it refuses only ``max_tokens`` beyond the whole
    context), pagedlearn refuses with a 400 in older vLLM's wording, so that a client learns its
    request was not what it asked for."""
    if max_tokens is not None and max_tokens < 1:
        raise ProtocolError(f"{field} must be at least 1, got {max_tokens}.", field)
    if prompt_len >= max_model_len:
        why = (
            "which exceeds this limit even without any output tokens"
            if prompt_len > max_model_len
            else "which leaves no room for a completion"
        )
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {prompt_len} input tokens, {why}. Please reduce the length of "
            "the input prompt.",
            prompt_field,
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "completion.",
            field,
        )
    return max_tokens


def check_pool(kv, prompt_len: int, params: SamplingParams, field: str = "max_tokens") -> None:
    """Refuse a request whose ``n`` samples of ``prompt_len + max_tokens`` tokens could never
    be held by the block pool of ``kv`` at once: it would be taken, then failed when it grew
    (``Scheduler._fail``). The count is the scheduler's own for re-admitting samples
    (readmission.py's ``readmission_blocks``): each sample's blocks, less the prompt's whole
    blocks that its siblings share (forked, copy-on-write). ``kv_reservation="max"`` reserves
    more (no sharing assumed), and admission refuses that itself. A model with sliding windows is
    not checked here: its windows give blocks back as they slide, so the scheduler decides."""
    if kv.has_sliding_window:
        return
    bs, pool, n = kv.block_size, kv.allocator.num_blocks, params.n
    shared = kv.blocks_needed(prompt_len // bs * bs)
    need = n * kv.blocks_needed(prompt_len + params.max_tokens) - (n - 1) * shared
    if need > pool:
        samples = f"{n} samples" if n > 1 else "one sample"
        raise ProtocolError(
            f"this request needs {need} blocks of {bs} tokens at once ({samples} of "
            f"{prompt_len} prompt + {params.max_tokens} completion tokens"
            + (f", sharing the prompt's {shared} whole blocks" if n > 1 and shared else "")
            + f"), more than the whole pool of {pool} blocks: ask for fewer samples (n) or "
            f"tokens ({field})",
            "n" if n > 1 else field,
        )
