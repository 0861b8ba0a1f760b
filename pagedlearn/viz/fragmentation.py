"""Where the KV memory goes: contiguous reservation vs paging, for a small set of requests.

Before PagedAttention, a serving system gave each request one *contiguous* run of KV slots,
reserved at admission for its whole life (Kwon et al., Section 2.3, Figures 2 and 3). Most of
that run is not holding KV at any moment:

- **token states**: slots holding the KV of tokens already processed (the only useful part);
- **reserved**: slots kept for tokens the request *will* generate (used later, idle now);
- **internal fragmentation**: slots reserved that the request will never use (it stops before
  its limit; for paging, the empty tail of each request's last block);
- **external fragmentation and other**: free slots that no waiting request can use, plus what
  the buddy allocator adds when it rounds a reservation up to a power of two.

Paging (vLLM) allocates one block at a time as tokens arrive, so the only waste is the unfilled
part of each request's last block, and more requests fit in the same pool.

Nothing here is computed by hand: every number and every slot drawn comes from the project's
simulator (:mod:`pagedlearn.sim.simulator`): :class:`~pagedlearn.sim.simulator.ContiguousMemory`
on a real buddy allocator for Orca's Max / Pow2 / Oracle policies, and
:class:`~pagedlearn.sim.simulator.PagedMemory` on the real :class:`~pagedlearn.KVCacheManager`.
"""

from __future__ import annotations

from dataclasses import replace

import matplotlib
from matplotlib.figure import Figure  # no pyplot: no global state, no windows
from matplotlib.patches import Patch, Rectangle

from pagedlearn.errors import PagedLearnError
from pagedlearn.sim.paper import SYSTEMS, figure2_parts, make_memory
from pagedlearn.sim.plots import FIG2_PARTS, LABELS, OKABE_ITO, STYLE
from pagedlearn.sim.simulator import simulate
from pagedlearn.sim.workloads import MAX_CONTEXT, Request

# The Figure 2 categories, in its order and colours, plus the two parts of the last one.
PARTS = [(key, label) for key, _, label in FIG2_PARTS]
COLORS = dict(zip([k for k, _ in PARTS], OKABE_ITO, strict=False))
COLORS.update(buddy_rounding=OKABE_ITO[3], free="#D9D9D9")
STRIP_LABELS = {
    "token_states": "token states",
    "reserved": "reserved (future tokens)",
    "internal": "internal frag. (never used)",
    "buddy_rounding": "buddy rounding",
    "free": "free",
}
TEXT_ON = {OKABE_ITO[0]: "white"}  # white text on the dark blue, black on the other colours
MIN_INSIDE = 6.0  # % of the bar a segment needs for its label to fit inside it


def as_requests(requests, max_context: int | None = None) -> list[Request]:
    """The :class:`~pagedlearn.sim.workloads.Request` list the simulator takes.

    Each item is a ``Request`` (``sim.workloads.paper_workload`` makes them) or a tuple
    ``(prompt_len, output_len)`` / ``(prompt_len, output_len, max_tokens)`` of ints: the prompt's
    tokens, the tokens it really generates before it stops, and the most it was allowed to
    generate (what Orca's Max reserves for); without ``max_tokens`` a request may fill the
    model's context, ``max_context`` (default 2048, OPT's). Tuples get ids 0, 1, 2, ...
    """
    if isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
        raise TypeError(
            f"requests must be a list of Request or tuples, got {type(requests).__name__}"
        )
    context = MAX_CONTEXT if max_context is None else max_context
    if not isinstance(context, int) or context < 2:
        raise ValueError(f"max_context must be an int >= 2, got {max_context!r}")
    out = []
    for i, r in enumerate(requests):
        if isinstance(r, Request):
            req = r
        elif isinstance(r, (tuple, list)) and len(r) in (2, 3) and all(_is_int(x) for x in r):
            limit = r[2] if len(r) == 3 else context - r[0]
            req = Request(i, 0.0, r[0], r[1], limit)
        else:
            raise TypeError(
                f"requests[{i}] must be a Request or a tuple (prompt_len, output_len"
                f"[, max_tokens]) of ints, got {r!r}"
            )
        if req.prompt_len < 1 or req.output_len < 1:
            raise ValueError(f"requests[{i}]: prompt_len and output_len must be >= 1, got {r!r}")
        if req.output_len > req.max_tokens:
            raise ValueError(
                f"requests[{i}]: it generates {req.output_len} tokens but may generate at most "
                f"max_tokens={req.max_tokens} (the context is {context}): {r!r}"
            )
        if max_context is not None and req.prompt_len + req.max_tokens > max_context:
            raise ValueError(
                f"requests[{i}]: prompt_len + max_tokens = {req.prompt_len + req.max_tokens} "
                f"exceeds max_context={max_context}"
            )
        out.append(req)
    if not out:
        raise ValueError("requests is empty: give at least one request")
    ids = [r.request_id for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"request ids must be unique, got {ids}")
    return out


def _check_pool(pool_slots, block_size) -> None:
    if not _is_int(pool_slots) or pool_slots < 1:
        raise ValueError(f"pool_slots must be a positive int (token slots), got {pool_slots!r}")
    if not _is_int(block_size) or not 1 <= block_size <= pool_slots:
        raise ValueError(f"block_size must be an int in 1..pool_slots, got {block_size!r}")


def fragmentation_breakdown(
    requests, pool_slots: int, block_size: int = 16, systems=SYSTEMS, max_context=None
) -> list[dict]:
    """Serve ``requests`` under each system and say where the pool's slots went (paper Fig. 2).

    ``requests``: see :func:`as_requests` (``Request`` objects or ``(prompt_len, output_len[,
    max_tokens])`` tuples); all arrive at step 0, a saturated server as in the paper's
    measurement. ``pool_slots``: KV token slots in the pool. ``systems``: any of "max", "pow2",
    "oracle" (Orca's contiguous reservations) and "vllm" (paging, ``block_size`` tokens a block).

    One row per system: the % of the pool in ``token_states``, ``reserved``, ``internal`` and
    ``external_and_other`` (= ``buddy_rounding`` + ``free``; the four sum to 100), averaged over
    the steps under load (past the warm-up, with requests waiting) as ``sim.paper.figure2``
    does (a small set whose queue empties before the warm-up ends keeps all its steps with a
    queue); ``mean_batch`` (average running requests over the same steps), ``preemptions``,
    ``steps_averaged``, ``under_load`` and ``label``. ``under_load`` is False when every request
    fit at once (no queue, ever): the average then covers the steps when all of them ran
    together, and "free" is room to spare, not fragmentation.
    """
    reqs = as_requests(requests, max_context)
    _check_pool(pool_slots, block_size)
    if isinstance(systems, str) or not systems or any(s not in SYSTEMS for s in systems):
        raise ValueError(f"systems must be a non-empty list from {SYSTEMS}, got {systems!r}")
    rows = []
    for system in systems:
        memory = make_memory(system, pool_slots, block_size)
        result = simulate(reqs, memory)
        # The simulator averages past a warm-up of one mean output length (a long saturated run
        # must turn its batch over first). A small set may have drained its queue by then: keep
        # its steps under load instead of averaging over the tail where the pool empties.
        loaded = [s for s in result.snapshots if s.waiting]
        if not loaded:  # no queue ever: show the pool while every request ran together
            peak = max(s.running for s in result.snapshots)
            window = [s for s in result.snapshots if s.running == peak]
            result = replace(result, snapshots=window, warmup=0)
        elif not any(s.step >= result.warmup for s in loaded):
            result = replace(result, warmup=0)
        b = result.mean_breakdown()
        rows.append(
            {
                "system": system,
                "label": memory.name,
                **figure2_parts(b),
                "free": b["free"],
                "mean_batch": result.mean_batch(),
                "preemptions": result.preemptions,
                "steps_averaged": len(result.loaded()),
                "under_load": bool(loaded),  # False: everything fit at once, no queue ever
            }
        )
    return rows


def draw_fragmentation(rows, *, title: str | None = None) -> Figure:
    """Stacked horizontal bars, one per row of :func:`fragmentation_breakdown`, in Figure 2's
    categories and order; each segment's % is written on it (small ones beside the bar) and
    each system's average batch under its name."""
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError("rows must be a non-empty list of fragmentation_breakdown rows")
    for i, row in enumerate(rows):
        missing = [k for k, _ in PARTS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"rows[{i}] lacks {missing}: pass fragmentation_breakdown's rows")
        if any(row[k] is None or row[k] < 0 for k, _ in PARTS):
            raise ValueError(f"rows[{i}] has a missing or negative share: {row!r}")
    with matplotlib.rc_context(STYLE):
        height = 1.9 + 0.8 * len(rows)
        fig = Figure(figsize=(10.5, height))
        ax = fig.subplots()
        ys = list(range(len(rows)))
        left = [0.0] * len(rows)
        for key, label in PARTS:
            values = [row[key] for row in rows]
            bars = ax.barh(ys, values, 0.7, left=left, color=COLORS[key], edgecolor="white",
                           label=label)  # fmt: skip
            text = [f"{v:.1f}%" if v >= MIN_INSIDE else "" for v in values]
            ax.bar_label(bars, text, label_type="center", fontsize=10,
                         color=TEXT_ON.get(COLORS[key], "black"))  # fmt: skip
            left = [a + v for a, v in zip(left, values, strict=True)]
        for y, row in zip(ys, rows, strict=True):  # the small segments, named beside the bar
            small = [f"{lab} {row[k]:.1f}%" for k, lab in PARTS if 0 < row[k] < MIN_INSIDE]
            if small:
                ax.text(101, y, "\n".join(small), va="center", fontsize=10, clip_on=False)
        names = [
            row.get("label") or LABELS.get(row.get("system"), row.get("system")) for row in rows
        ]
        names = [f"{n}\n{_batch_note(row)}".strip() for n, row in zip(names, rows, strict=True)]
        ax.set_yticks(ys, names)
        ax.invert_yaxis()  # the first row on top
        ax.set_xlim(0, 100)
        ax.set_xlabel("% of the KV-cache pool (average over the steps under load)")
        ax.set_title(title or "Where the KV memory goes (paper Figure 2 style)")
        fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=4, frameon=False)
        fig.tight_layout(rect=(0, 0.5 / height, 1, 1))
        return fig


def _batch_note(row) -> str:
    if "mean_batch" not in row:
        return ""
    if row.get("under_load") is False:  # see fragmentation_breakdown: nothing ever waited
        return f"all {row['mean_batch']:.0f} fit, no queue"
    return f"avg batch {row['mean_batch']:.1f}"


class _Watch:
    """Wraps a memory model for :func:`simulate`; at the ``step``-th step it copies the layout
    of the pool at the moment the simulator measures it (after admission, before the step's
    tokens), with that step's snapshot numbers."""

    def __init__(self, memory, step: int):
        self.memory, self.name, self.step, self.calls = memory, memory.name, step, 0
        self.layout, self.parts = None, None

    def admit(self, req, length):
        return self.memory.admit(req, length)

    def grow(self, req, length):
        return self.memory.grow(req, length)

    def release(self, req):
        self.memory.release(req)

    def breakdown(self, running_lengths):
        parts = self.memory.breakdown(running_lengths)
        if self.calls == self.step:
            self.layout, self.parts = _layout(self.memory, running_lengths), parts
        self.calls += 1
        return parts


def _layout(memory, running_lengths) -> list[tuple[int, int, str, int | None]]:
    """``(start slot, slots, category, request id or None)`` for every slot of the pool."""
    segments = []
    if hasattr(memory, "buddy"):  # contiguous: one run per request, from the buddy allocator
        for req, length in running_lengths:
            offset, size = memory.held[req.request_id]
            rounded = memory.buddy.allocated_size(offset)
            x = offset
            parts = {
                "token_states": length,  # tokens processed so far
                "reserved": req.final_len - length,  # tokens it will still generate
                "internal": size - req.final_len,  # reserved but never used
                "buddy_rounding": rounded - size,  # the buddy's round-up to a power of two
            }
            for part, n in parts.items():
                if n > 0:
                    segments.append((x, n, part, req.request_id))
                    x += n
        segments += [(o, n, "free", None) for o, n in memory.buddy.free_runs()]
    else:  # paging: each request's blocks, wherever the block manager put them
        kv, bs = memory.kv, memory.block_size
        if hasattr(kv, "group_tables"):  # block_table() would be one KV-cache group's only
            raise PagedLearnError(
                "the reservation-vs-paging strip lays out one block table per request (the "
                "paper's Figure 2, full attention); a KVCacheCoordinator keeps one per KV-cache "
                "group over a shared pool: draw it with draw_block_pool or draw_block_tables"
            )
        used = set()
        for req, _ in running_lengths:
            n = kv.num_tokens(req.request_id)
            for j, block in enumerate(kv.block_table(req.request_id)):
                held = min(bs, n - j * bs)  # only the last block can be partly empty
                segments.append((block * bs, held, "token_states", req.request_id))
                if held < bs:
                    segments.append((block * bs + held, bs - held, "internal", req.request_id))
                used.add(block)
        num_blocks = kv.allocator.num_blocks
        segments += [(b * bs, bs, "free", None) for b in range(num_blocks) if b not in used]
        if memory.num_slots > num_blocks * bs:  # a tail too short for a block: never usable
            tail = num_blocks * bs
            segments.append((tail, memory.num_slots - tail, "free", None))
    return sorted(segments)


def reservation_vs_paging(
    requests, pool_slots: int, block_size: int = 16, step: int | None = None
) -> tuple[int, list[dict]]:
    """What :func:`draw_reservation_vs_paging` draws, without drawing: ``(step, strips)``, one
    strip for Orca (Max) and one for paging, each a dict with the memory model's ``name``, the
    ``running`` and ``waiting`` requests and ``token_states`` slots at that step, and
    ``segments``: ``(start slot, slots, category, request id or None)`` covering the pool."""
    reqs = as_requests(requests)
    _check_pool(pool_slots, block_size)
    if step is None:
        step = min(r.output_len for r in reqs) // 2
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an int >= 0 (an engine step), got {step!r}")
    strips = []
    for system in ("max", "vllm"):
        watch = _Watch(make_memory(system, pool_slots, block_size), step)
        result = simulate(reqs, watch, max_steps=step + 1)
        if watch.layout is None:
            raise ValueError(
                f"step {step} is past the end of the run: {watch.name} serves every request "
                f"in {result.steps} steps (0..{result.steps - 1})"
            )
        snap = result.snapshots[step]
        strips.append({"name": watch.name, "running": snap.running, "waiting": snap.waiting,
                       "token_states": snap.token_states, "segments": watch.layout})  # fmt: skip
    return step, strips


def draw_reservation_vs_paging(
    requests, pool_slots: int, block_size: int = 16, step: int | None = None
) -> Figure:
    """The same pool at the same step, twice: Orca (Max) reservations above, paging below.

    Both strips are read from the simulator's memory models at step ``step`` (default: half the
    shortest request's output, so the first requests are mid-way and none has finished), at the
    moment Figure 2 measures: after admission, before the step's tokens. Top: each running
    request's contiguous run from the buddy allocator (tokens held, slots reserved for its future
    tokens, slots it will never use, buddy rounding) and the free gaps. Bottom: the blocks the
    :class:`~pagedlearn.KVCacheManager` gave each request, only the last one partly empty.
    Boxes outline each request's slots (labelled R<id> where they fit). Meant for a handful of
    requests (4 to 6); ``requests`` as :func:`fragmentation_breakdown` takes.
    """
    step, strips = reservation_vs_paging(requests, pool_slots, block_size, step)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(12, 4.6))
        axes = fig.subplots(2, 1, sharex=True)
        for ax, strip in zip(axes, strips, strict=True):
            # White block borders help while blocks are a few pixels wide; past ~200 they would
            # paint the strip white.
            edge = 0.5 if pool_slots <= 200 * block_size else 0
            _draw_strip(ax, strip["segments"], pool_slots, edge)
            used = 100 * strip["token_states"] / pool_slots
            ax.set_title(f"{strip['name']}: {strip['running']} running, {strip['waiting']} "
                         f"waiting; token states {used:.0f}% of the pool", loc="left")  # fmt: skip
        axes[1].set_xlabel(f"KV-cache token slots (pool of {pool_slots}; step {step})")
        handles = [
            Patch(facecolor=COLORS[k], edgecolor="grey", label=v) for k, v in STRIP_LABELS.items()
        ]
        fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        return fig


def _draw_strip(ax, segments, pool_slots, edge_width) -> None:
    """One horizontal bar per category (so a test can read each category's rectangles), then an
    outline and a label for each request's run of slots."""
    for part in STRIP_LABELS:
        mine = [(x, n) for x, n, p, _ in segments if p == part]
        ax.barh([0] * len(mine), [n for _, n in mine], 0.8, left=[x for x, _ in mine],
                color=COLORS[part], edgecolor="white", lw=edge_width, label=part)  # fmt: skip
    # Runs of consecutive slots owned by one request: a box, and its name if it fits.
    runs = []
    for x, n, _, rid in segments:
        if rid is not None and runs and runs[-1][2] == rid and runs[-1][0] + runs[-1][1] == x:
            runs[-1][1] += n
        elif rid is not None:
            runs.append([x, n, rid])
    for x, n, rid in runs:
        ax.add_patch(Rectangle((x, -0.4), n, 0.8, fill=False, edgecolor="black", linewidth=1.0))
        if n >= 0.025 * pool_slots:
            box = {"facecolor": "white", "edgecolor": "none", "pad": 1, "alpha": 0.8}
            ax.text(x + n / 2, 0, f"R{rid}", ha="center", va="center", fontsize=10, bbox=box)
    ax.set_xlim(0, pool_slots)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
