"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeded.

The reported log-probability of a token is taken from the model's *raw* distribution
(``log_softmax(logits)``), before temperature or truncation, so that cumulative log-probabilities
compare across sampling settings (and equal beam search's scores for the same tokens). The
per-token logprobs a request may ask for (``SamplingParams.logprobs``) come from the same rows:
:meth:`Sampler.token_logprobs`.

:func:`sample_step` puts the drawn tokens into a request's sequences: it forks the ``n`` samples
of a request at its first token, checks each sequence for a stop and frees the finished ones --
the sampling counterpart of :func:`~pagedlearn.engine.beam_search.beam_step`.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedlearn.engine.request import Logprob, Request
from pagedlearn.engine.sampling_params import SamplingParams


class Sampler:
    """Picks next tokens from one step's logits ``(S, vocab)``, one row per scheduled sequence."""

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """``log_softmax`` of all rows at once, on the CPU (sampling and beam search read them
        there); float32 ``(S, vocab)``."""
        return torch.log_softmax(logits.float(), dim=-1).cpu()

    def greedy(self, logprobs: torch.Tensor) -> list[tuple[int, float]]:
        """Every row's greedy pick ``(token, logprob)`` at once (``logprobs``: ``(S, vocab)`` from
        :meth:`logprobs`): one reduction for the step instead of one per sequence. Ties go to the
        lowest id, as ``torch.argmax`` (and :meth:`sample`). Through numpy, because the engine
        calls this every step and on a matrix this small a torch call's fixed cost is most of
        the work; numpy's argmax also takes the first maximum (tests check it against torch)."""
        rows = logprobs.numpy()  # (S, vocab) float32, sharing the tensor's memory
        best = rows.argmax(axis=-1)  # (S,)
        return list(zip(best.tolist(), rows[np.arange(len(rows)), best].tolist(), strict=True))

    def sample(
        self,
        logprobs: torch.Tensor,  # (vocab,) one row of self.logprobs(...)
        params: SamplingParams,
        num_samples: int = 1,
        generator: torch.Generator | None = None,
    ) -> list[tuple[int, float]]:
        """``num_samples`` independent draws ``(token, logprob)`` from one row."""
        if params.greedy:  # argmax; ties go to the lowest id, as in transformers
            token = int(torch.argmax(logprobs))
            return [(token, float(logprobs[token]))] * num_samples
        scores = logprobs / params.temperature  # same softmax as logits / T: the shift cancels
        if params.top_k > 0 and params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
            # Keep a token if the probability mass *before* it is still below top_p: the most
            # likely token always survives.
            drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        tokens = torch.multinomial(probs, num_samples, replacement=True, generator=generator)
        return [(int(t), float(logprobs[t])) for t in tokens]

    def token_logprobs(
        self,
        logprobs: torch.Tensor,  # (vocab,) one row of self.logprobs(...)
        tokens: list[int],
        k: int,
    ) -> list[dict[int, Logprob]]:
        """vLLM's per-token logprobs of each of ``tokens`` (drawn from this row), as a dict in
        vLLM's order: the drawn token first, with its log-probability and its rank (1 + the
        number of tokens strictly more likely), then the ``k`` most likely tokens, ranks 1..k
        (so k or k + 1 entries). The drawn token among the k keeps its own rank (the two differ
        only on a tie). Each token gets its own dict, even where several samples drew the same."""
        top: list[tuple[int, float]] = []
        if k:
            values, ids = torch.topk(logprobs, k)  # (k,) best first
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        row = logprobs.numpy()  # the rank through numpy: its comparison costs a few times less
        out = []
        for tok in tokens:
            lp = row[tok]
            entry = {tok: Logprob(float(lp), 1 + int(np.count_nonzero(row > lp)))}
            for rank, (t, v) in enumerate(top, start=1):
                entry.setdefault(t, Logprob(v, rank))
            out.append(entry)
        return out


def sample_step(engine, req: Request, logprobs: torch.Tensor, rows: list[int], best) -> None:
    """One step of a sampling request (beam search has :func:`~pagedlearn.engine.beam_search.
    beam_step`): each live sequence of ``req`` draws its next token from its row of
    ``logprobs`` (``(S, vocab)``; ``rows``: the request's rows, one per sequence; ``best``:
    every row's greedy pick, computed once for the step). At the first prefill of a request
    with ``n > 1`` the one row draws ``n`` tokens: the sequence forks into ``n`` samples that
    share the prompt's blocks (``kv.fork``). Each new token is checked for a stop
    (``engine._stop_reason``); a finished sequence moves to ``req.done`` and frees its blocks.
    Called from ``LLMEngine._process``, which snapshots ``req`` first (recovery.py)."""
    p = req.params
    fork = p.n > 1 and req.next_seq_index == 1  # the first prefill: one row, n samples
    live = []
    for seq, row in zip(list(req.seqs), rows, strict=True):
        if p.greedy:
            draws = [best[row]] * (p.n if fork else 1)
        else:
            draws = engine.sampler.sample(logprobs[row], p, p.n if fork else 1, req.generator)
        children = [seq] + [
            req.new_sequence(list(seq.token_ids), logprobs=seq.logprobs) for _ in draws[1:]
        ]
        tops = [None] * len(draws)  # per draw: its logprobs entry, if the request asked
        if seq.logprobs is not None:
            tops = engine.sampler.token_logprobs(logprobs[row], [t for t, _ in draws], p.logprobs)
        for child, (tok, lp), top in zip(children, draws, tops, strict=True):
            child.token_ids.append(tok)
            if top is not None:
                child.logprobs.append(top)
            child.cumulative_logprob += lp
            child.finish_reason = engine._stop_reason(p, child, tok)
            if child is not seq and not child.finished:
                engine.kv.fork(seq.seq_id, child.seq_id)  # share the prompt's blocks
            if child.finished:
                req.done.append(child)
            else:
                live.append(child)
        if seq.finished:
            engine.kv.free_sequence(seq.seq_id)
    req.seqs = live
