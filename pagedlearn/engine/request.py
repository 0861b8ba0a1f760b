"""Requests, their sequences, and what the engine hands back (vLLM's shapes and names).

A *request* is one prompt with its parameters. It owns one or more *sequences*: one for plain
generation, ``n`` for parallel sampling, up to ``beam_width`` live beams for beam search. Every
sequence is a block table in the :class:`~pagedlearn.KVCacheManager`, under the id
``"<request_id>.<i>"``; sequences of one request share blocks through ``fork``.

A request moves between the scheduler's queues::

    WAITING --admit (prefill)--> RUNNING --finish / abort--> FINISHED
       ^                          |   ^
       +--preempt (recompute)-----+   +--swap in--  SWAPPED  <--preempt (swap)--+

A sequence's ``token_ids`` are its prompt plus every token sampled so far. The newest sampled token
has no K/V yet: it is fed to the model in the next step, which writes its K/V into the slot the
manager gives it. So between steps the manager holds ``len(token_ids) - 1`` tokens of a running
sequence, and a sequence that is re-prefilled after a recompute preemption feeds all of them.

A sequence whose request asks for ``SamplingParams.logprobs`` also keeps one dict per sampled
token (token id -> :class:`Logprob`), in step with its output tokens: a preemption keeps both, a
step that raised rolls both back (recovery.py), and a forked sample gets its own copy.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from pagedlearn.engine.sampling_params import BeamSearchParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Logprob:
    """One token's entry in a position's logprobs, as ``vllm.logprobs.Logprob``: its
    log-probability under the model's raw distribution, and its rank (1: the most likely).
    ``decoded_token`` is left None by the engine (the server decodes what it sends)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class Sequence:
    """One generated continuation: its tokens, score so far, and why it stopped (if it did)."""

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    index: int = 0  # its place among the request's outputs
    # One {token id: Logprob} per output token, if the request asked (SamplingParams.logprobs)
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_text_has(self, stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> bool:
        """Whether the output's text now contains one of the ``stop`` strings, decoding only its
        last few tokens with ``decode`` (the engine asks after every sampled token).

        Why the tail suffices: asked after every token, a match found now ends in the newest
        token's text (an earlier one would have ended an earlier step), so it lies within the
        last B UTF-8 bytes of the text, for a stop string of B bytes. The window of tokens
        decoded grows (doubling) until its text holds B + 4 bytes, or reaches the output's
        start: a token decodes to at least one byte (byte-level BPE; SentencePiece's byte
        fallback) unless it is special (EOS, padding: nothing, since the text skips them), and
        the 4 spare bytes cover a character whose bytes began before the window (decoded as a
        replacement character there) and a tokenizer that drops a leading space."""
        need = max(len(s.encode()) for s in stop) + 4
        ids, start = self.token_ids, self.num_prompt_tokens
        window = need
        while True:
            lo = max(start, len(ids) - window)
            text = decode(ids[lo:])
            if lo == start or len(text.encode()) >= need:
                return any(s in text for s in stop)
            window *= 2


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter()`` seconds) of one request, and what operators derive."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per step that produced tokens
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first sampled token (queueing + prefill)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def mean_itl(self) -> float | None:
        """Mean inter-token latency: the average gap between successive decode steps."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        """End-to-end time: arrival -> finished."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class Request:
    """One prompt being served. ``seqs`` are its live sequences; ``done`` the finished ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    metrics: RequestMetrics
    arrival_index: int  # FCFS order: smaller arrived earlier
    seqs: list[Sequence] = field(default_factory=list)
    done: list[Sequence] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    generator: object = None  # torch.Generator when params.seed is set
    next_seq_index: int = 0
    error: str | None = None
    num_faults: int = 0  # steps in a row that raised while it was in flight (recovery.py)
    # Per sequence id: tokens whose K/V a recompute preemption dropped. Planned again below
    # that position, a token is *recomputed* (SchedulerOutput counts it); emptied once passed.
    kv_dropped: dict[str, int] = field(default_factory=dict)
    # Extra keys of its blocks' hashes (prefix_cache.py): requests share cached KV only when
    # both are equal (admission.py reads them from the prompt and add_request's arguments).
    cache_salt: Hashable = None
    adapter_id: Hashable = None  # the LoRA adapter's id; pagedlearn applies no adapter
    # Whether step() hands out its output only when it finishes (vLLM's
    # RequestOutputKind.FINAL_ONLY, which LLM.generate asks for), not at every step.
    final_only: bool = False

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def seq_ids(self) -> list[str]:
        return [s.seq_id for s in self.seqs]

    def new_sequence(
        self, token_ids: list[int], cumulative_logprob: float = 0.0, logprobs: list | None = None
    ) -> Sequence:
        """The request's next sequence; ``logprobs``: its output tokens' logprobs so far (a
        fork's parent's, copied), kept only if the request asks for them."""
        i = self.next_seq_index
        self.next_seq_index += 1
        wants = getattr(self.params, "logprobs", None) is not None  # beam search: never
        return Sequence(
            f"{self.request_id}.{i}",
            token_ids,
            len(self.prompt_token_ids),
            cumulative_logprob,
            index=i,
            logprobs=list(logprobs or ()) if wants else None,
        )


@dataclass
class CompletionOutput:
    """One sample (or beam) of a request, as in ``vllm.CompletionOutput``.

    ``text`` is decoded from ``token_ids`` on first use: the engine hands out outputs for every
    request at every step, and decoding them all each time would cost more than scheduling.

    With stop strings (``SamplingParams.stop``), as vLLM: a sample that a stop string ended
    (finish reason "stop") has its ``text`` cut before it (after it, with
    ``include_stop_str_in_output``), while its ``token_ids`` keep every token; a running sample's
    ``text`` holds back its last ``len(longest stop string) - 1`` characters, which may be the
    start of a stop string that the next token completes (nothing with
    ``include_stop_str_in_output``).

    ``logprobs`` (with ``SamplingParams.logprobs``; None otherwise): one dict per token of
    ``token_ids``, token id -> :class:`Logprob`, holding the sampled token and the k most likely.
    """

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    detokenize: Callable[[list[int]], str] | None = field(default=None, repr=False, compare=False)
    stop: tuple[str, ...] = field(default=(), repr=False, compare=False)
    include_stop_str_in_output: bool = field(default=False, repr=False, compare=False)
    logprobs: list[dict[int, Logprob]] | None = None

    @functools.cached_property
    def text(self) -> str:
        text = self.detokenize(self.token_ids) if self.detokenize else ""
        if not self.stop:
            return text
        if self.finish_reason is None:  # running: hold back what may start a stop string
            held = 0 if self.include_stop_str_in_output else max(map(len, self.stop)) - 1
            return text[: len(text) - held]
        if self.finish_reason == "stop":
            # The first stop string (in the list's order) found is the one that ended it: the
            # engine checked after every token, so none occurred before the last token's text.
            # (EOS or a stop token id also end with "stop"; then no stop string occurs at all.)
            for s in self.stop:
                if (at := text.find(s)) >= 0:
                    return text[: at + (len(s) if self.include_stop_str_in_output else 0)]
        return text


@dataclass
class RequestOutput:
    """What ``generate`` returns per prompt, and ``step`` per request that made progress."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why the request was rejected, if it was

    def __repr__(self) -> str:
        texts = [o.text for o in self.outputs]
        return (
            f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, "
            f"outputs={texts!r}, num_cached_tokens={self.num_cached_tokens})"
        )
