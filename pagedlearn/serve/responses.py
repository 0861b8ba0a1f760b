"""What the server sends back: OpenAI's response bodies and stream chunks, from RequestOutputs.

One :class:`Reply` per HTTP request shapes what the engine hands out the way OpenAI (and vLLM)
do, for ``kind`` "completion" (``/v1/completions``, ``object: "text_completion"``) or "chat"
(``/v1/chat/completions``, ``"chat.completion"`` / ``"chat.completion.chunk"``)::

    non-streaming:  reply.response(final output)  -> {"id", "object", "created", "model",
                                                      "choices": [...], "usage": {...}}
    streaming:      reply.opening()     chat: one chunk per choice with {"role": "assistant"}
                    reply.chunks(out)   per output: one chunk per choice with new text (a delta)
                    reply.usage_chunk(out)   with stream_options.include_usage: the last one

A stream sends only what will not change. Its text is decoded incrementally, as vLLM's
detokenizer does (``detokenize_incrementally``, :func:`decode_incrementally`): each chunk
decodes only the tokens since the last text it could send, with a few before them as context,
not the whole output again (that would cost time quadratic in the output's length). A running
sample's tail may still change: bytes of a character not complete yet decode to U+FFFD (held
back until the character is whole), and the last ``len(longest stop string) - 1`` characters
may start a stop string (held back, as ``CompletionOutput.text`` does). The finished output's
text is decoded once, whole, and the stream sends the rest of it; so the deltas of a stream add
up to the non-streaming text. Each chunk carries the tokens that are new since the last one --
one per step, as vLLM sends them, its text "" while that is held back; with a reader slower
than the engine, several tokens at once (see engine_loop.py: outputs are cumulative).

Logprobs, when asked for, come in each endpoint's own shape: completions' ``{"tokens",
"token_logprobs", "top_logprobs", "text_offset"}`` (the top dicts hold the k most likely and the
sampled token) and chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [k
entries]}]}``. Tokens are decoded one by one (vLLM does the same), so a token holding part of a
UTF-8 character shows as U+FFFD; a log-probability of -inf is sent as -9999.0 (JSON has no
infinity; vLLM's value). Completions' ``top_logprobs`` is keyed by the decoded text, so where
several tokens decode to the same text (every byte >= 0x80 of a byte tokenizer is U+FFFD) it
shows the most likely of them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pagedlearn.engine.request import CompletionOutput, RequestOutput

MIN_LOGPROB = -9999.0


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(out: RequestOutput) -> dict:
    """Token counts of a finished output (``usage``), with the prompt tokens served from the
    prefix cache (``prompt_tokens_details.cached_tokens``)."""
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def decode_incrementally(
    decode: Callable[[list[int]], str], token_ids: list[int], prefix: int, read: int
) -> tuple[str, int, int]:
    """vLLM's incremental detokenization: the text that ``token_ids[read:]`` add, and the new
    ``(prefix, read)`` offsets. ``token_ids[prefix:read]`` is context decoded with them (a
    tokenizer may write a token differently at the start of a text: a leading space dropped, a
    character begun before it), and the difference of the two decodings is the new text.
    Nothing moves while that ends in U+FFFD (the next token may complete the character) or is
    empty (special tokens)."""
    prefix_text = decode(token_ids[prefix:read])
    new_text = decode(token_ids[prefix:])
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return "", prefix, read
    return new_text[len(prefix_text) :], read, len(token_ids)


@dataclass
class _Progress:
    """What a stream sent of one choice, and its decoding state."""

    chars: int = 0  # characters of text sent
    tokens: int = 0  # tokens sent (their logprobs)
    offset: int = 0  # completions' text_offset of the next token
    held: str = ""  # text decoded, not sent yet (it may start a stop string)
    prefix: int = 0  # decode_incrementally's offsets into the token ids
    read: int = 0


def held_back(c: CompletionOutput) -> int:
    """Characters a running sample holds back: what may start a stop string
    (``CompletionOutput.text``'s rule)."""
    if not c.stop or c.include_stop_str_in_output:
        return 0
    return max(map(len, c.stop)) - 1


class Reply:
    """Shapes one request's outputs (see the module docstring). ``logprobs``: the k asked for
    (None: none)."""

    def __init__(self, kind: str, model: str, tokenizer, logprobs: int | None = None) -> None:
        self.kind, self.model, self.tokenizer, self.k = kind, model, tokenizer, logprobs
        self.id, self.created = new_id(kind), int(time.time())
        self._sent: dict[int, _Progress] = {}  # per choice index
        self._done: set[int] = set()

    # --- non-streaming ------------------------------------------------------------------------
    def response(self, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            lp = self._logprobs(c.token_ids, c.logprobs, 0) if self.k is not None else None
            choice: dict = {"index": c.index}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append({**choice, "logprobs": lp, "finish_reason": c.finish_reason})
        return {**self._head(final=True), "choices": choices, "usage": usage(out)}

    # --- streaming ----------------------------------------------------------------------------
    def opening(self, n: int) -> list[dict]:
        """Chat's first chunks: the assistant's role, one per choice (completions: none)."""
        if self.kind != "chat":
            return []
        delta = {"role": "assistant", "content": ""}
        return [self._chunk(i, delta, None, None) for i in range(n)]

    def chunks(self, out: RequestOutput) -> list[dict]:
        """One chunk per choice with something new in ``out``: text, tokens whose logprobs
        were asked for, or its finish reason."""
        chunks = []
        for c in out.outputs:
            if c.index in self._done:
                continue
            sent = self._sent.setdefault(c.index, _Progress())
            new_ids = c.token_ids[sent.tokens :]
            if not new_ids and c.finish_reason is None:
                continue  # nothing new (a chunk per new token, as vLLM: its text may be "")
            text = self._new_text(c, sent)
            lp = None
            if self.k is not None and new_ids:
                lps = c.logprobs[sent.tokens :] if c.logprobs else None
                lp = self._logprobs(new_ids, lps, sent.offset)
                sent.offset += sum(len(t) for t in lp["tokens"]) if self.kind != "chat" else 0
            sent.chars, sent.tokens = sent.chars + len(text), len(c.token_ids)
            if c.finish_reason is not None:
                self._done.add(c.index)
            delta = {"content": text} if self.kind == "chat" else text
            chunks.append(self._chunk(c.index, delta, lp, c.finish_reason))
        return chunks

    def _new_text(self, c: CompletionOutput, sent: _Progress) -> str:
        """The text of ``c`` to send now: a finished sample's rest (its whole text decoded
        once, cut at its stop string), else what the new tokens decode to, less the tail held
        back."""
        if c.finish_reason is not None:
            return c.text[sent.chars :]
        decode = c.detokenize or (lambda ids: "")
        new, sent.prefix, sent.read = decode_incrementally(
            decode, c.token_ids, sent.prefix, sent.read
        )
        sent.held += new
        ready = len(sent.held) - held_back(c)
        if ready <= 0:
            return ""
        text, sent.held = sent.held[:ready], sent.held[ready:]
        return text

    def usage_chunk(self, out: RequestOutput) -> dict:
        return {**self._head(final=False), "choices": [], "usage": usage(out)}

    # --- shapes -------------------------------------------------------------------------------
    def _head(self, final: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion" if final else "chat.completion.chunk"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, index: int, delta, logprobs, finish_reason) -> dict:
        choice: dict = {"index": index}
        if self.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return {**self._head(final=False), "choices": [choice]}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict] | None, offset: int) -> dict:
        """``token_ids``' logprobs (one dict per token: id -> Logprob) in the endpoint's shape;
        ``offset``: the text offset of the first of them (completions)."""
        logprobs = logprobs or [{} for _ in token_ids]
        if self.kind == "chat":
            entries = zip(token_ids, logprobs, strict=True)
            return {"content": [self._chat_entry(t, d) for t, d in entries]}
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, d in zip(token_ids, logprobs, strict=True):
            token = self._decode(t)
            tokens.append(token)
            token_lps.append(_value(d[t].logprob) if t in d else None)
            ranked = sorted(d.items(), key=lambda kv: kv[1].rank)  # k most likely + sampled
            top: dict[str, float] = {}
            for i, lp in ranked:  # keyed by text: the most likely of tokens that read the same
                top.setdefault(self._decode(i), _value(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, d: dict) -> dict:
        token = self._decode(token_id)
        top = sorted((kv for kv in d.items() if kv[1].rank <= self.k), key=lambda kv: kv[1].rank)
        own = d.get(token_id)
        return {
            "token": token,
            "logprob": _value(own.logprob) if own is not None else MIN_LOGPROB,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {
                    "token": (s := self._decode(i)),
                    "logprob": _value(lp.logprob),
                    "bytes": list(s.encode("utf-8")),
                }
                for i, lp in top
            ],
        }

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _value(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)
