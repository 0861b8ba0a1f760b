"""How to pick next tokens: :class:`SamplingParams` (vLLM's names) and :class:`BeamSearchParams`.

Parameters are checked when they are made, so a bad value fails at once with a message that names
it, before any request is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedlearn.errors import PagedLearnError

MAX_LOGPROBS = 20  # the most top tokens per position ``logprobs`` may ask for (vLLM's default)
MAX_SEED = 2**63 - 1  # vLLM's range (an int64); torch's Generator takes no more than 2**64 - 1
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing the logits by a
# smaller one overflows them all to -inf, and softmax turns that into NaN probabilities.
SAMPLING_EPS = 1e-5


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise PagedLearnError(f"{name} must be an int >= {low}, got {value!r}")


def _stop_strings(stop) -> tuple[str, ...]:
    """``stop`` (None, a str, or a list / tuple of str) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise PagedLearnError(
            f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}"
        )
    for s in items:  # the engine compares their UTF-8 bytes (Sequence.output_text_has)
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PagedLearnError(
                f"stop must be valid Unicode text: {s!r} holds a lone surrogate at {e.start}"
            ) from None
    return tuple(items)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, as in ``vllm.SamplingParams``.

    - ``max_tokens``: the most tokens to generate (the request finishes with reason "length").
    - ``temperature``: 0 is greedy (argmax); higher flattens the distribution. Below
      :data:`SAMPLING_EPS` (1e-5) is greedy too, as in vLLM's ``sampling_type``: the logits
      divided by a tinier one overflow. (vLLM 0.33 also raises a temperature in (0, 0.01) to
      0.01 with a warning; pagedlearn samples at the temperature given.)
    - ``top_k`` (-1: off) and ``top_p`` (1.0: off) cut the distribution to the k most likely
      tokens / the smallest set whose probability reaches p, before sampling.
    - ``seed``: a private random generator for this request, so its samples are reproducible
      whatever else runs in the same batch; an int in [0, 2**63 - 1].
    - ``n``: how many samples of the same prompt. They share the prompt's KV blocks (fork) and
      copy only the last, partly filled block when they first write different tokens into it.
    - ``stop_token_ids``: extra tokens that end a sample (finish reason "stop"); the model's EOS
      always does, unless ``ignore_eos`` (useful to generate fixed lengths in benchmarks).
    - ``stop``: strings (one, or a list) that end a sample as soon as its decoded text contains
      one (finish reason "stop"). Its ``text`` is cut before the stop string (after it with
      ``include_stop_str_in_output``); its ``token_ids`` keep every sampled token, the ones
      that spelled the stop string included, as in vLLM. Only samples with stop strings pay for
      decoding, and only the last few tokens of them per step (``LLMEngine._stop_reason``).
    - ``logprobs``: None (off), or k in [0, 20]: every sampled token comes with its
      log-probability and rank (1: the most likely) and the k most likely tokens' (vLLM's
      semantics; ``CompletionOutput.logprobs``). Values are the model's raw distribution,
      before temperature, top-k and top-p; only the requests that ask pay for them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)  # a str or a list of str is accepted
    include_stop_str_in_output: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("n", self.n, 1)
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise PagedLearnError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise PagedLearnError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise PagedLearnError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise PagedLearnError(
                f"seed must be None or an int in [0, 2**63 - 1], got {self.seed!r}"
            )
        try:
            stops = tuple(int(t) for t in self.stop_token_ids)
        except (TypeError, ValueError):
            raise PagedLearnError(
                f"stop_token_ids must be ints, got {self.stop_token_ids!r}"
            ) from None
        object.__setattr__(self, "stop_token_ids", stops)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        if not isinstance(self.include_stop_str_in_output, bool):
            raise PagedLearnError(
                "include_stop_str_in_output must be True or False, got "
                f"{self.include_stop_str_in_output!r}"
            )
        k = self.logprobs
        bad_k = not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS
        if k is not None and bad_k:
            raise PagedLearnError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}"
            )

    @property
    def greedy(self) -> bool:
        """Argmax instead of sampling: a temperature below :data:`SAMPLING_EPS` (the one place
        that decides: the sampler and the engine ask it)."""
        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings, as in ``vllm.sampling_params.BeamSearchParams``.

    Each step keeps the ``beam_width`` best partial sequences by cumulative log-probability. Beams
    are forked sequences: they share their common past's KV blocks (copy-on-write), and a beam
    that falls out of the top ``beam_width`` frees its blocks at once. A finished beam is scored
    ``cumulative_logprob / num_generated_tokens ** length_penalty`` (1.0: average log-probability
    per token; 0: no normalisation, which favours short outputs).
    """

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.length_penalty, (int, float)):
            raise PagedLearnError(f"length_penalty must be a number, got {self.length_penalty!r}")

    @property
    def n(self) -> int:
        return self.beam_width

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return ()

    def score(self, cumulative_logprob: float, num_tokens: int) -> float:
        return cumulative_logprob / max(num_tokens, 1) ** self.length_penalty
