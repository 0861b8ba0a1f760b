"""The text panels beside the pool picture: stats line, key, request list, block inspector.

Both views show them (laid out by :mod:`pagedlearn.viz.view`); each is a pure function of a
:class:`~pagedlearn.viz.state.PoolState`, so a replay shows the same text the live view showed.

An engine's stats line also shows what an operator watches (engine/metrics.py): KV usage and
the fewest free blocks seen, the prefix-cache hit rate over a recent window, and the p50 / p99
time to first token once a request has had one -- each only when the frame carries it.

With several KV-cache groups (a model with sliding-window layers) the stats line adds the blocks
each group holds and those the sliding windows have handed back so far, the key says what each
cell's group tag means, the request list counts a request's blocks over all its groups (``7 (F
5, S 2)``), and the inspector names the group a block belongs to.
"""

from __future__ import annotations

import html
from dataclasses import replace

from pagedlearn.core.block_table import NULL_BLOCK
from pagedlearn.viz.pool_labels import FIXED_LOOKS, group_entries, group_tags, token_text
from pagedlearn.viz.state import PoolState, RequestState, step_label
from pagedlearn.viz.style import OUTLINE_COLOR

MAX_FINISHED_ROWS = 20
# nowrap (inherited by every cell): a request name never breaks mid-word
TABLE = "margin-right:2em;white-space:nowrap;border-spacing:10px 1px"
# ...except a list of names, which may break after its commas: a server's request ids are long
# (``cmpl-`` and 32 hex digits) and its sequences repeat them, so a request with two sequences
# would make the table wider than a notebook column. The view lets the table scroll in its own
# box when even that is too wide (pagedlearn/viz/view.py).
NAMES = "white-space:normal"


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
    owners = (
        ", ".join(f"{state.seq_of(s)} (request {state.group_of(s)})" for s in b.owners) or "none"
    )
    tokens = token_text(b.token_ids, tokenizer) if b.token_ids else "(none)"
    ids = f"\ntoken ids: {list(b.token_ids)}" if tokenizer is not None and b.token_ids else ""
    group = ""
    if state.kv_groups and b.owners:  # one group per block: the groups share no block
        name = state.kv_group_of(b.owners[0])
        group = f"KV-cache group: {name} (tag {group_tags(state.kv_groups)[name]})\n"
    return (
        f"block {block_id}: {kind}\n"
        f"{group}"
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
        # The operator's numbers (engine/metrics.py) when the frame has them: a trace recorded
        # before they existed has not, and its stats line stays as it was.
        if "kv_cache_usage" in s and "min_free_blocks" in s:
            parts.append(
                f"KV usage: {100 * s['kv_cache_usage']:.0f}%, fewest free {s['min_free_blocks']}"
            )
        recent = s.get("prefix_hit_rate_recent")
        parts += [
            f"requests: {s['num_running']} running, {s['num_waiting']} waiting, "
            f"{s['num_swapped']} swapped",
            f"preemptions: {s['preemptions_recompute'] + s['preemptions_swap']}",
            f"CoW copies: {s['cow_copies']}",
            f"prefix hit rate: {s['prefix_hit_rate']:.1f}%"
            + ("" if recent is None else f" (recent {recent:.1f}%)"),
        ]
        # No latency here: a frame's picture must read the same on every run of a chapter
        # (the stats' TTFT p50 / p99 are in the frame's data and in timing_summary()).
    # KV-cache groups: the engine's numbers when it has them (also once every table is gone),
    # else the frame's own (a coordinator driven by hand); a one-group model has neither.
    held = s.get("group_blocks")
    held = (held if isinstance(held, dict) else {}) or state.group_counts()
    if held:
        per = ", ".join(f"{html.escape(str(g))} {n}" for g, n in held.items())
        parts.append(f"blocks per group: {per}")
    if s.get("group_blocks"):
        parts.append(f"freed by sliding windows: {s.get('window_freed_blocks', 0)}")
    return " &middot; ".join(parts)


def swatch(color: str | None) -> str:
    """A coloured square (a request's colour); a hollow grey one for ``None``."""
    if color is None:
        return f"<span style='color:{OUTLINE_COLOR}'>&#9633;</span>"
    return f"<span style='color:{color}'>&#9632;</span>"


def key_html(state: PoolState | None = None) -> str:
    """What the uncoloured looks mean, as the static pictures' legend lists them (the live views'
    picture has no legend of its own: the request list beside it gives each request's colour);
    and, for a ``state`` with KV-cache groups, what each cell's group tag means."""

    def box(fill: str, label: str, hatch: bool) -> str:
        bg = f"repeating-linear-gradient(135deg,#000 0 1px,{fill} 1px 4px)" if hatch else fill
        return (
            f"<span style='display:inline-block;width:12px;height:12px;margin:0 3px 0 10px;"
            f"vertical-align:middle;background:{bg};border:1px solid {OUTLINE_COLOR}'></span>"
            f"{label}"
        )

    boxes = "".join(box(fill, label, bool(hatch)) for fill, _, hatch, label in FIXED_LOOKS)
    key = f"<span style='white-space:nowrap'>{boxes}</span>"
    if state is not None and state.kv_groups:
        tags = " &middot; ".join(html.escape(t) for t in group_entries(state.kv_groups))
        key += f"<br><span style='white-space:nowrap;margin-left:10px'>block tags: {tags}</span>"
    return key


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
        held = _held(state, r.seqs)
        done = r.status == "finished"
        color = None if done else state.colors.get(r.request_id)
        rows.append(
            [
                f"{swatch(color)} {html.escape(str(r.request_id))}",
                r.status + (f" ({html.escape(str(r.finish_reason))})" if done else ""),
                _names(r.seqs),
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
        seqs = groups.setdefault(state.group_of(s), [])
        if state.seq_of(s) not in seqs:  # a sequence once, whatever its KV-cache groups
            seqs.append(state.seq_of(s))
    alone = all(seqs == [g] for g, seqs in groups.items())  # no forks: one column is enough
    rows = []
    for g, seqs in groups.items():
        names = [n for s in seqs for n in state.tables_of(s)]  # a table per KV-cache group
        swapped = all(n in state.swapped for n in names)
        row = [
            f"{swatch(state.colors.get(g))} {html.escape(str(g))}",
            "swapped out" if swapped else "in the pool",
            _names(seqs),
            str(max(state.num_tokens.get(n, 0) for n in names)),
            _held(state, seqs),
        ]
        rows.append(row[:2] + row[3:] if alone else row)
    head = ("sequence", "status", "tokens", "blocks") if alone else (
        "request", "status", "seqs", "tokens", "blocks")  # fmt: skip
    return _table(head, rows, "no sequences in the pool")


def _names(names) -> str:
    """Names joined by commas, in a cell that may wrap between them (``NAMES``) but never
    inside one (``cmpl-`` would break at its hyphen)."""
    one = "<span style='white-space:nowrap'>{}</span>"
    joined = ", ".join(one.format(html.escape(str(n))) for n in names)
    return f"<span style='{NAMES}'>{joined}</span>"


def _held(state: PoolState, seqs) -> str:
    """The blocks sequences hold: distinct GPU blocks (null entries are none), ``(+n on CPU)``,
    and per KV-cache group by tag when the model has several (``7 (F 5, S 2)``)."""
    names = [n for s in seqs for n in state.tables_of(s)]
    gpu = {b for n in names for b in state.tables.get(n, ()) if b != NULL_BLOCK}
    cpu = sum(b != NULL_BLOCK for n in names for b in state.swapped.get(n, ()))
    held = f"{len(gpu)}"
    if state.kv_groups and gpu:
        tags = group_tags(state.kv_groups)
        per = {
            tags[g]: len({b for n in names if state.kv_group_of(n) == g
                          for b in state.tables.get(n, ()) if b != NULL_BLOCK})
            for g in state.kv_groups
        }  # fmt: skip
        held += " (" + ", ".join(f"{html.escape(t)} {k}" for t, k in per.items()) + ")"
    return held + (f" (+{cpu} on CPU)" if cpu else "")


def _table(head: tuple[str, ...], rows: list[list[str]], empty: str) -> str:
    th = "".join(f"<th style='text-align:left'>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    body = body or f"<tr><td colspan={len(head)}><i>{empty}</i></td></tr>"
    return f"<table style='{TABLE}'><tr>{th}</tr>{body}</table>"
