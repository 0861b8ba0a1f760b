"""The hot path of a step's sampling: one greedy token for a request with one sequence.

After the forward, :meth:`LLMEngine._process <pagedlearn.engine.llm_engine.LLMEngine._process>`
advances every request that sampled: snapshot it (recovery.py), pick its tokens (``_sample``,
forks, frees), take its timings, build its output. That general code serves every case --
parallel samples, beam search, seeded sampling, several rows per request -- through a few
layers of calls. Most requests in most steps are the simplest case, though: greedy, one
sequence, one row. :func:`decode_greedy` does exactly what the general code does for them, in
one function (``benchmarks/bench_engine.py`` prints the bookkeeping per step; set
``LLMEngine.fast_decodes = False`` and ``Scheduler.fast_decodes = False`` to compare).

``tests/test_engine_fast_paths.py`` runs whole workloads both ways and compares everything
they leave (every step's outputs, the block trace, the stats, the metrics; and the same
faults recovered the same way). To read what a step does, read the general code;
``LLMEngine.fast_decodes = False`` makes the engine use only that.
"""

from __future__ import annotations

from pagedlearn.engine.outputs import finish
from pagedlearn.engine.recovery import StepJournal
from pagedlearn.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from pagedlearn.engine.sampling_params import SamplingParams


def is_greedy_decode(req: Request) -> bool:
    """Whether :func:`decode_greedy` may advance ``req``: greedy sampling (no generator to
    snapshot) without per-token logprobs (``_sample`` computes those), one live sequence and no
    finished one (its output has one sample), and no fork to make (n = 1, or its samples forked
    already)."""
    p = req.params
    return (
        type(p) is SamplingParams
        and p.greedy
        and p.logprobs is None
        and len(req.seqs) == 1
        and not req.done
        and req.generator is None
        and (p.n == 1 or req.next_seq_index > 1)
    )


def decode_greedy(engine, req: Request, pick: tuple[int, float], now: float, journal: StepJournal):
    """Advance ``req`` (:func:`is_greedy_decode`) by its greedy ``pick`` ``(token, logprob)``
    as ``LLMEngine._process`` would: the same snapshot, token, stop check, frees, timings,
    metrics, output and journal entries, in the same order. Returns the request's output (None
    for a ``final_only`` request that goes on)."""
    journal.begin_one(req)  # journal.begin(req), for this case
    seq = req.seqs[0]
    tokens, m = seq.token_ids, req.metrics
    tok, lp = pick
    tokens.append(tok)
    seq.cumulative_logprob += lp
    p = req.params
    seq.finish_reason = reason = engine._stop_reason(p, seq, tok)
    if reason is None:
        req.seqs = [seq]
    else:
        req.done.append(seq)
        engine.kv.free_sequence(seq.seq_id)
        req.seqs = []
    if m.first_token_time is None:
        m.first_token_time = now
    m.token_times.append(now)
    engine.metrics.observe_tokens(m)
    if reason is None and req.final_only:
        out = None  # no output until it finishes
    elif reason is None:  # outputs.request_output, for one live sequence
        sample = CompletionOutput(
            seq.index, tokens[seq.num_prompt_tokens :], seq.cumulative_logprob, None,
            engine._detokenize, p.stop, p.include_stop_str_in_output,
        )  # fmt: skip
        out = RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, [sample],
            req.status is RequestStatus.FINISHED, m, req.num_cached_tokens, req.error,
        )  # fmt: skip
    else:
        engine.scheduler.remove(req)
        out = finish(engine, req)
    req.num_faults = 0
    journal.done(req, out)
    return out
