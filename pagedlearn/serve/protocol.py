"""What a client may send: OpenAI's request bodies (pydantic models), checked and turned into
:class:`~pagedlearn.SamplingParams`.

Two endpoints take a body: ``POST /v1/completions`` (:class:`CompletionRequest`) and
``POST /v1/chat/completions`` (:class:`ChatCompletionRequest`). Their fields are OpenAI's, plus
vLLM's extensions that pagedlearn's engine implements (``top_k``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``cache_salt``). A body is refused with a
400 that names the field when:

- a field is unknown (``extra="forbid"``): a typo never passes silently, and neither does a
  field pagedlearn has no code for at all (OpenAI's ``tools``' relatives, vLLM's ``min_p``, ...);
- a field pagedlearn does not implement has a value other than its neutral one (:data:`NEUTRAL`:
  ``presence_penalty`` 0, ``echo`` false, ``best_of`` equal to ``n``, ...): a client that sends
  the defaults works, one that asks for the feature learns it is missing;
- a value has the wrong JSON type. Types are strict, as OpenAI's API is (pydantic's strict
  mode): an integer field (``max_tokens``, ``n``, ``seed``, a token id) takes a JSON integer,
  not ``"4"``, ``true`` or ``4.0``; a boolean takes ``true``/``false``, not ``"true"`` or ``1``;
  a number field (``temperature``, ``top_p``) takes an integer too (``"temperature": 1``), as
  JSON Schema's ``number`` does. Token ids (a prompt sent as ids, ``stop_token_ids``) are ints
  >= 0, and below the model's vocabulary size where the caller gives it (:func:`check_token_ids`);
- a value is out of range (``SamplingParams``' own checks: a ``seed`` in [0, 2**63 - 1], a
  finite ``temperature``, ...);
- any string anywhere in the body -- the prompt, a message, ``stop``, ``user``, ``cache_salt``, a
  message's ``name``, a key of ``logit_bias`` -- holds a lone surrogate (JSON allows
  ``"\\ud800"``; no tokenizer can encode it, and it has no UTF-8): one walk over the whole body
  (:meth:`_Body.check_text`), not a list of fields, so a field added later is covered;
- ``cache_salt`` breaks vLLM's rule (:func:`check_cache_salt`);
- the prompt alone, or the prompt plus ``max_tokens``, do not fit the served context
  (:func:`resolve_max_tokens`): pagedlearn refuses the second with a 400 where vLLM 0.33 would
  shorten ``max_tokens`` to what is left, with older vLLM's wording;
- the request's samples could never be held by the block pool at once (:func:`check_pool`).

The checks beyond types (:func:`check_token_ids`, :func:`check_cache_salt`,
:func:`resolve_max_tokens`, :func:`check_pool`, ...) live in request_checks.py.

A message that quotes what the client sent quotes a bounded prefix of it (middleware.py's
``preview``): a body of 1,000 stop strings of 10 kB gets an error of a few hundred bytes, not
10 MB.

Defaults are OpenAI's: ``temperature`` 1 (sampling: send 0 for greedy), ``top_p`` 1, ``n`` 1;
``max_tokens`` 16 for completions, and for chat (or an explicit ``null``) the rest of the context,
as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from pagedlearn.engine.sampling_params import SamplingParams
from pagedlearn.errors import PagedLearnError
from pagedlearn.serve.middleware import clip, preview
from pagedlearn.serve.request_checks import (
    ProtocolError,
    bad_token_id,
    check_cache_salt,
    check_token_ids,
    resolve_max_tokens,
    utf8_text,
)

TokenId = Annotated[int, Field(ge=0)]  # (below the vocabulary size: check_token_ids)


class _Body(BaseModel):
    """A part of a request body: unknown fields refused, JSON types strict (an int is not
    ``"4"``, ``true`` or ``4.0``; a float field takes an int, as pydantic's strict mode allows)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def check_text(self, prefix: str = "") -> None:
        """Refuse a lone surrogate in any string of this body, at any depth (nested parts,
        lists, a dict's keys and values): the one rule for every string field. Iterative, so a
        deeply nested ``tools`` cannot exhaust Python's stack."""
        todo = [(getattr(self, n), prefix + n) for n in reversed(type(self).model_fields)]
        while todo:  # depth first, in the body's order: the first bad string is the one named
            value, path = todo.pop()
            if isinstance(value, str):
                utf8_text(value, path)
            elif isinstance(value, _Body):
                names = reversed(type(value).model_fields)
                todo += [(getattr(value, n), f"{path}.{n}") for n in names]
            elif isinstance(value, (list, tuple)):
                todo += [(value[i], f"{path}.{i}") for i in range(len(value) - 1, -1, -1)]
            elif isinstance(value, dict):  # (a key's path would quote the key: the dict's path)
                todo += [(x, path) for kv in reversed(value.items()) for x in reversed(kv)]


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # (vLLM's; accepted at its neutral value)


class _SamplingRequest(_Body):
    """The fields both endpoints share."""

    model: str | None = None  # None: the one model served (vLLM accepts that too)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; None, 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None  # (each non-empty: check)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    # OpenAI's, not implemented: accepted only at their neutral value (NEUTRAL)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    cache_salt: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = None  # (each endpoint has its own default)

    # what the context check names when the prompt alone is too long
    prompt_field: ClassVar[str] = "prompt"

    def check(self) -> None:
        """Refuse what pagedlearn does not implement, and vLLM's own cross-field rules. (A lone
        surrogate is refused earlier, by :meth:`check_text`, which the prompt's readers --
        ``one_prompt``, ``chat_messages`` -- run before the tokenizer sees any text: once per
        body, not again here.)"""
        for name, (neutral, allowed) in NEUTRAL.items():
            if name in type(self).model_fields and not neutral(getattr(self, name), self):
                raise ProtocolError(
                    f"{name}={preview(getattr(self, name))} is not supported by pagedlearn's "
                    f"server (it accepts only {allowed}); leave it out",
                    name,
                )
        if isinstance(self.stop, list) and "" in self.stop:
            raise ProtocolError(
                f"stop.{self.stop.index('')} is empty: each stop string must be non-empty", "stop"
            )
        if self.stream_options is not None and not self.stream:
            raise ProtocolError(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ProtocolError(
                "stream_options.continuous_usage_stats=true is not supported by pagedlearn's "
                "server (include_usage is: one usage chunk at the end)",
                "stream_options",
            )
        check_cache_salt(self.cache_salt)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The ``max_tokens`` asked for, and the name of the field that asked."""
        return self.max_tokens, "max_tokens"

    def logprobs_k(self) -> int | None:
        return None

    def sampling_params(
        self, prompt_len: int, max_model_len: int, vocab_size: int | None = None
    ) -> SamplingParams:
        """The engine's parameters for a prompt of ``prompt_len`` tokens (400s: ProtocolError);
        ``vocab_size``: the model's, which every stop token id must be below (None: unchecked)."""
        self.check()
        check_token_ids(self.stop_token_ids or (), vocab_size, "stop_token_ids")
        asked, field = self.requested_max_tokens()
        max_tokens = resolve_max_tokens(asked, prompt_len, max_model_len, field, self.prompt_field)
        top_k = -1 if self.top_k in (None, 0) else self.top_k
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=top_k,
                seed=self.seed,
                n=self.n,
                stop=self.stop or None,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=self.logprobs_k(),
            )
        except PagedLearnError as e:  # SamplingParams' messages start with the field's name
            name = str(e).split(" ", 1)[0]  # (they quote the whole value: cut, as error_body does)
            raise ProtocolError(clip(str(e)), self.param_name(name)) from None

    def param_name(self, name: str) -> str:
        return name


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # k: the sampled token's logprob and the k most likely
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_error_for_prompt(cls, value, handler):
        """One error for a prompt of the wrong type, not one per type it may have (pydantic
        reports a union's every member: "a valid string", "a valid list", ...)."""
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "prompt_type",
                "Input should be a valid string, a list of token ids (ints >= 0), or a list of "
                "one of those{detail}",
                {"detail": bad_token_id(value)},
            ) from None

    def one_prompt(self, vocab_size: int | None = None) -> str | list[int]:
        """The prompt (checked: :meth:`check_text`; its token ids below ``vocab_size``, if
        given); a batch of prompts in one body (OpenAI allows it) is refused."""
        self.check_text()
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ProtocolError(
                    f"pagedlearn's server takes one prompt per request, got a list of {len(p)}; "
                    "send them as separate requests (they are batched together anyway)",
                    "prompt",
                )
            p = p[0]
        if not isinstance(p, str):
            check_token_ids(p, vocab_size, "prompt")
        return p

    def logprobs_k(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: messages, turned into one prompt by chat.py."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # OpenAI's, not implemented: accepted only at their neutral value (NEUTRAL)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise ProtocolError(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )

    prompt_field: ClassVar[str] = "messages"

    def chat_messages(self) -> list[dict]:
        """The messages as ``{"role", "content"}`` dicts (content as text), for chat.py; every
        string of the body checked first (:meth:`check_text`)."""
        self.check_text()
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def param_name(self, name: str) -> str:
        return "top_logprobs" if name == "logprobs" else name


# Fields OpenAI defines and pagedlearn does not implement: (is the value neutral?, in words).
NEUTRAL = {
    "presence_penalty": (lambda v, r: not v, "0 or null"),
    "frequency_penalty": (lambda v, r: not v, "0 or null"),
    "logit_bias": (lambda v, r: not v, "{} or null"),
    "echo": (lambda v, r: not v, "false"),
    "suffix": (lambda v, r: not v, '"" or null'),
    "best_of": (lambda v, r: v is None or v == r.n, "null or best_of == n"),
    "tools": (lambda v, r: not v, "[] or null"),
    "tool_choice": (lambda v, r: v in (None, "none"), '"none" or null'),
    "response_format": (lambda v, r: not v or v == {"type": "text"}, '{"type": "text"} or null'),
}
