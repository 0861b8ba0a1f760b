"""The text panels beside the pool picture: stats line, key, request list, block inspector.

Both views show them (laid out by :mod:`pagedlearn.viz.view`); each is a pure function of a
:class:`~pagedlearn.viz.state.PoolState`, so a replay shows the same text the live view showed.
"""

from __future__ import annotations

import html
from dataclasses import replace

from pagedlearn.viz.pool_labels import FIXED_LOOKS, token_text
from pagedlearn.viz.state import PoolState, RequestState, step_label
from pagedlearn.viz.style import OUTLINE_COLOR

MAX_FINISHED_ROWS = 20
# nowrap (inherited by every cell): a request name never breaks mid-word
TABLE = "margin-right:2em;white-space:nowrap;border-spacing:10px 1px"


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
    label = step_label(state)
    parts = [] if label is None else [f"<b>{html.escape(label)}</b>"]
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


def swatch(color: str | None) -> str:
    """A coloured square (a request's colour); a hollow grey one for ``None``."""
    if color is None:
        return f"<span style='color:{OUTLINE_COLOR}'>&#9633;</span>"
    return f"<span style='color:{color}'>&#9632;</span>"


def key_html() -> str:
    """What the uncoloured looks mean, as the static pictures' legend lists them (the live views'
    picture has no legend of its own: the request list beside it gives each request's colour)."""

    def box(fill: str, label: str, hatch: bool) -> str:
        bg = f"repeating-linear-gradient(135deg,#000 0 1px,{fill} 1px 4px)" if hatch else fill
        return (
            f"<span style='display:inline-block;width:12px;height:12px;margin:0 3px 0 10px;"
            f"vertical-align:middle;background:{bg};border:1px solid {OUTLINE_COLOR}'></span>"
            f"{label}"
        )

    boxes = "".join(box(fill, label, bool(hatch)) for fill, _, hatch, label in FIXED_LOOKS)
    return f"<span style='white-space:nowrap'>{boxes}</span>"


def requests_html(state: PoolState, finished: list[RequestState]) -> str:
    """The request list: live requests as the state lists them (in their colour), then those
    finished so far (hollow grey: they hold no colour any more, it may be a newcomer's now). A
    manager driven by hand has no requests: then its sequences, grouped as the pictures colour
    them. Colours: ``state.colors`` (both views draw painted states; without colours, hollow
    squares)."""
    if not state.requests and not finished:
        return _sequences_html(state)
    live = [r for r in state.requests if r.status != "finished"]
    cut = max(0, len(finished) - MAX_FINISHED_ROWS)
    rows = []
    for r in live + finished[cut:]:
        gpu = {b for s in r.seqs for b in state.tables.get(s, ())}
        cpu = sum(len(state.swapped.get(s, ())) for s in r.seqs)
        held = f"{len(gpu)}" + (f" (+{cpu} on CPU)" if cpu else "")
        done = r.status == "finished"
        color = None if done else state.colors.get(r.request_id)
        rows.append(
            [
                f"{swatch(color)} {html.escape(str(r.request_id))}",
                r.status + (f" ({html.escape(str(r.finish_reason))})" if done else ""),
                html.escape(", ".join(map(str, r.seqs))),
                str(r.prompt_tokens or "-"),
                "-" if done and not r.output_tokens else str(r.output_tokens),
                "-" if done else held,
            ]
        )
    more = f"<p><i>{cut} earlier finished requests not listed</i></p>" if cut else ""
    head = ("request", "status", "seqs", "prompt", "output", "blocks")
    return _table(head, rows, "no requests") + more


def _sequences_html(state: PoolState) -> str:
    groups: dict = {}
    for s in (*state.tables, *state.swapped):
        groups.setdefault(state.group_of(s), []).append(s)
    alone = all(seqs == [g] for g, seqs in groups.items())  # no forks: one column is enough
    rows = []
    for g, seqs in groups.items():
        gpu = {b for s in seqs for b in state.tables.get(s, ())}
        cpu = sum(len(state.swapped.get(s, ())) for s in seqs)
        swapped = all(s in state.swapped for s in seqs)
        row = [
            f"{swatch(state.colors.get(g))} {html.escape(str(g))}",
            "swapped out" if swapped else "in the pool",
            html.escape(", ".join(map(str, seqs))),
            str(max(state.num_tokens.get(s, 0) for s in seqs)),
            f"{len(gpu)}" + (f" (+{cpu} on CPU)" if cpu else ""),
        ]
        rows.append(row[:2] + row[3:] if alone else row)
    head = ("sequence", "status", "tokens", "blocks") if alone else (
        "request", "status", "seqs", "tokens", "blocks")  # fmt: skip
    return _table(head, rows, "no sequences in the pool")


def _table(head: tuple[str, ...], rows: list[list[str]], empty: str) -> str:
    th = "".join(f"<th style='text-align:left'>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    body = body or f"<tr><td colspan={len(head)}><i>{empty}</i></td></tr>"
    return f"<table style='{TABLE}'><tr>{th}</tr>{body}</table>"
