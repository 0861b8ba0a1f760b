"""One step of beam search over forked sequences.

After a forward pass every live beam has a next-token distribution. The step

1. scores each beam's ``2 * beam_width`` best continuations by cumulative log-probability;
2. walks them best first: a continuation ending in EOS is a *finished* beam (kept aside with its
   length-penalised score); the others become the next live beams until there are
   ``beam_width`` of them;
3. makes the memory match: a beam chosen once keeps its sequence; a beam chosen again is
   ``fork``-ed (its blocks shared, refcount +1; the partly filled last block is copied on the
   next write); a beam not chosen at all is freed -- its blocks go back to the pool at once,
   except those its surviving siblings still share.

It stops when ``max_tokens`` is reached or when ``beam_width`` finished beams exist and no live
beam's current score beats the worst of them (the usual heuristic, as transformers'
``early_stopping=False``).

**The result, however the search ends, is at most ``beam_width`` beams**
(:func:`keep_best_beams`): the finished beams and the live ones together, ranked by the same
length-penalised score, best first, as vLLM's ``beam_search`` ranks its completed and live beams.
A live beam ends cut short, and its finish reason says why: "length" (``max_tokens``, the
model's length, or no live beam can still win), "abort" (the request was aborted), "error" (the
request failed -- e.g. its beams outgrew the whole pool -- and ``RequestOutput.error`` says why).
So a failed beam search still hands back the best it found, next to the error.
"""

from __future__ import annotations

import torch

from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine.request import Request, Sequence


def beam_step(
    req: Request,
    beams: list[Sequence],
    logprobs: torch.Tensor,  # (num_beams, vocab): row i belongs to beams[i]
    kv: KVCacheManager,
    eos_token_id: int | None,
    max_model_len: int,
) -> None:
    """Advance ``req``'s beams by one token, in place (its ``seqs`` and ``done``). With no live
    beam left the search is over, and the engine's ``finish`` ranks what it found
    (:func:`keep_best_beams`)."""
    p = req.params
    width = p.beam_width
    top = torch.topk(logprobs, min(2 * width, logprobs.shape[-1]), dim=-1)
    candidates = [
        (beam.cumulative_logprob + float(lp), i, int(tok))
        for i, beam in enumerate(beams)
        for lp, tok in zip(top.values[i], top.indices[i], strict=True)
    ]
    candidates.sort(key=lambda c: -c[0])  # best first; sort is stable, so ties keep beam order

    chosen: list[tuple[float, int, int]] = []
    for rank, (cum, i, tok) in enumerate(candidates):
        if tok == eos_token_id and not p.ignore_eos:
            if rank < width:  # an EOS continuation only counts among the top beam_width
                req.done.append(_finished(req, [*beams[i].token_ids, tok], cum, "stop"))
            continue
        chosen.append((cum, i, tok))
        if len(chosen) == width:
            break

    # Forks first, while the parents' token lists are untouched; then parents take their token.
    first_use: dict[int, tuple[float, int]] = {}
    new_beams: list[Sequence] = []
    for cum, i, tok in chosen:
        if i not in first_use:
            first_use[i] = (cum, tok)
            continue
        child = req.new_sequence([*beams[i].token_ids, tok], cum)
        kv.fork(beams[i].seq_id, child.seq_id)
        new_beams.append(child)
    for i, beam in enumerate(beams):
        if i in first_use:
            beam.cumulative_logprob, tok = first_use[i]
            beam.token_ids.append(tok)
            new_beams.append(beam)
        else:
            kv.free_sequence(beam.seq_id)  # fell out of the beam: its blocks go back now
    req.seqs = new_beams

    num_generated = len(new_beams[0].output_token_ids) if new_beams else 0
    out_of_room = bool(new_beams) and len(new_beams[0].token_ids) >= max_model_len
    if num_generated >= p.max_tokens or out_of_room or _cannot_improve(req):
        for beam in new_beams:
            kv.free_sequence(beam.seq_id)
            req.done.append(_finished(req, beam.token_ids, beam.cumulative_logprob, "length"))
        req.seqs = []


def keep_best_beams(req: Request) -> None:
    """End a beam search: its live beams join the finished ones (each keeps its finish reason),
    and only the ``beam_width`` best by score stay, best first (``index`` = rank). Called by
    ``outputs.finish`` however the search ended (:func:`beam_step` finished it, an abort, a
    failure), so that a beam search never hands back more than ``beam_width`` beams."""
    req.done.extend(req.seqs)
    req.seqs = []
    req.done.sort(key=lambda s: -_score(req, s))  # stable: ties keep their order
    req.done = req.done[: req.params.beam_width]
    for rank, seq in enumerate(req.done):
        seq.index = rank


def _score(req: Request, seq: Sequence) -> float:
    return req.params.score(seq.cumulative_logprob, len(seq.output_token_ids))


def _finished(req: Request, token_ids: list[int], cum: float, reason: str) -> Sequence:
    seq = Sequence(f"{req.request_id}.done", token_ids, len(req.prompt_token_ids), cum, reason)
    return seq


def _cannot_improve(req: Request) -> bool:
    width = req.params.beam_width
    if len(req.done) < width or not req.seqs:
        return False
    worst_kept = sorted((_score(req, s) for s in req.done), reverse=True)[width - 1]
    best_live = max(_score(req, s) for s in req.seqs)
    return best_live <= worst_kept
