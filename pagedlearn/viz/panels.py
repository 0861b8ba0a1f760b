"""The text panels beside the pool picture: stats line, request list, block inspector.

Both views (:mod:`pagedlearn.viz.live`) show them; each is a pure function of a
:class:`~pagedlearn.viz.state.PoolState`, so a replay shows the same text the live view showed.
"""

from __future__ import annotations

import html
from dataclasses import replace

from pagedlearn.viz.pool import token_text
from pagedlearn.viz.state import PoolState, RequestState
from pagedlearn.viz.style import Palette

MAX_FINISHED_ROWS = 20


class RequestBook:
    """Requests seen so far: finished ones stay listed (with their finish reason) after the
    step that finished them, as a dashboard would."""

    def __init__(self) -> None:
        self._last: dict[str, RequestState] = {}
        self._finished: dict[str, RequestState] = {}

    def update(self, state: PoolState) -> list[RequestState]:
        """Take in the next state; returns the requests finished so far, oldest first."""
        for r in state.requests:
            if r.status != "finished":
                self._last[r.request_id] = r
                continue
            prev = self._last.get(r.request_id)
            if prev is not None:  # a finished entry names no sequences: its last known ones
                r = replace(r, seqs=r.seqs or prev.seqs)
            self._finished[r.request_id] = r
        return list(self._finished.values())


def inspect_block(state: PoolState, block_id: int, tokenizer=None) -> str:
    """A plain-text description of block ``block_id`` in ``state``."""
    if isinstance(block_id, bool) or not isinstance(block_id, int):
        raise TypeError(f"block_id must be an int, got {type(block_id).__name__}")
    if not 0 <= block_id < state.num_blocks:
        raise ValueError(
            f"no block {block_id}: the pool has {state.num_blocks} (ids 0..{state.num_blocks - 1})"
        )
    b = state.blocks[block_id]
    kind = {
        "free": "free (empty)",
        "cached": "free, but cached: a prefix-cache hit can reuse it until it is evicted",
        "used": "used by one sequence",
        "shared": f"shared by {b.refcount} block tables",
    }[b.kind]
    if b.kind == "shared":  # only a partly filled block is ever written again
        full = b.num_tokens == state.block_size
        kind += " (full: never copied)" if full else " (a write will copy it first: CoW)"
    owners = ", ".join(f"{s} (request {state.group_of(s)})" for s in b.owners) or "none"
    tokens = token_text(b.token_ids, tokenizer) if b.token_ids else "(none)"
    ids = f"\ntoken ids: {list(b.token_ids)}" if tokenizer is not None and b.token_ids else ""
    return (
        f"block {block_id}: {kind}\n"
        f"refcount: {b.refcount}\n"
        f"fill: {b.num_tokens}/{state.block_size} slots\n"
        f"owners: {owners}\n"
        f"hash: {b.block_hash[:12] if b.block_hash else 'not cached'}\n"
        f"tokens: {tokens}{ids}"
    )


def stats_html(state: PoolState) -> str:
    """One line of numbers for a frame (the engine's stats when the state has them)."""
    used = state.count("used") + state.count("shared")
    parts = [] if state.step is None else [f"<b>step {state.step}</b>"]
    parts.append(
        f"blocks: {used} used ({state.count('shared')} shared), {state.count('cached')} "
        f"cached, {state.count('free')} free of {state.num_blocks}"
    )
    s = state.stats
    if s:
        parts += [
            f"requests: {s['num_running']} running, {s['num_waiting']} waiting, "
            f"{s['num_swapped']} swapped",
            f"preemptions: {s['preemptions_recompute'] + s['preemptions_swap']}",
            f"CoW copies: {s['cow_copies']}",
            f"prefix hit rate: {s['prefix_hit_rate']:.1f}%",
        ]
    return " &middot; ".join(parts)


def requests_html(state: PoolState, finished: list[RequestState], palette: Palette) -> str:
    """The request list: live requests as the state lists them, then those finished so far."""
    live = [r for r in state.requests if r.status != "finished"]
    cut = max(0, len(finished) - MAX_FINISHED_ROWS)
    rows = []
    for r in live + finished[cut:]:
        gpu = {b for s in r.seqs for b in state.tables.get(s, ())}
        cpu = sum(len(state.swapped.get(s, ())) for s in r.seqs)
        held = f"{len(gpu)}" + (f" (+{cpu} on CPU)" if cpu else "")
        done = r.status == "finished"
        color = palette.color(r.request_id)
        cells = [
            f"<span style='color:{color}'>&#9632;</span> {html.escape(str(r.request_id))}",
            r.status + (f" ({html.escape(str(r.finish_reason))})" if done else ""),
            html.escape(", ".join(map(str, r.seqs))),
            str(r.prompt_tokens or "-"),
            "-" if done and not r.output_tokens else str(r.output_tokens),
            "-" if done else held,
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>" for h in ("request", "status", "seqs", "prompt", "output", "blocks")
    )
    more = f"<p><i>{cut} earlier finished requests not listed</i></p>" if cut else ""
    body = "".join(rows) or "<tr><td colspan=6><i>no requests</i></td></tr>"
    return f"<table style='margin-right:2em'><tr>{head}</tr>{body}</table>{more}"
