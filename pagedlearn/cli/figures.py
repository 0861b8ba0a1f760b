"""``python -m pagedlearn figures``: regenerate every PNG in ``figures/`` from the real code.

Nothing in ``figures/`` is drawn by hand. Each picture comes from a run of the project's own code,
seeded and offline, so that running the command twice gives the same pictures:

- ``block_pool.png``, ``block_tables.png``, ``memory_timeline.png``: the demo's mixed batch
  (:mod:`pagedlearn.cli.demo`: chats sharing a system prompt, parallel sampling, beam search, a
  cancelled request, preemption) served by the engine on the offline ``tiny-gpt2`` with the
  PyTorch attention backend, recorded, and drawn from the recording at the step that best shows
  scattered and shared blocks (:func:`headline_frame`; the replay draws exactly what the live
  view showed);
- ``reservation_vs_paging.png``, ``fragmentation.png``: the same requests under max-length
  contiguous reservation and under paging, on the simulator with the real ``KVCacheManager``;
- ``lab_feedback.png``: what a student sees when a lab check fails (:func:`lab_feedback`);
- ``paper_*.png``, ``prefix_caching.png``: the paper's memory figures (``python -m pagedlearn
  paper``), unless ``--no-paper``.

``--quick`` runs smaller simulations, whose pictures differ from the committed ones: the command
then writes them into a new temporary directory (printed) unless ``--out DIR`` says where, so
that ``figures/`` keeps what the README describes. (:func:`make_figures` writes where it is told.)

Beside the pictures, ``data.json`` holds the numbers each one draws, by figure name (the PNG's
stem). A picture's pixels change with matplotlib's version; its numbers change only when the
code does. So ``tests/test_figures.py`` recomputes the numbers, without drawing, and fails when
the committed ones differ: a figure that no longer shows what the code does is caught in CI.
Our own figures are recomputed whole (:func:`own_figures` with ``draw=False``); the paper's
memory figures take minutes at full size, so the test recomputes a few of their rows (the
entries record their sizes). A figure's :data:`MEASURED` entry holds what this machine timed
(Figures 19 and 12): kept for the record and never compared; Figure 19's block layout (blocks
and bytes per block size) is compared like the rest.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

DEMO_MODEL = "tiny-gpt2"  # offline and seeded: the same weights, so the same run, everywhere
MEASURED = "measured"  # the key, in a figure's data, of what this machine timed (not compared)


def record_demo_run(model: str = DEMO_MODEL, block_size: int = 16):
    """Serve the demo's requests on ``model`` and return the recorded ``EventLog``.

    Same requests and pool sizing as ``make demo``; the cancelled request is aborted when
    :func:`~pagedlearn.cli.demo.cancel_due` says so, as there.
    """
    from pagedlearn import LLM
    from pagedlearn.cli.demo import cancel_due, default_num_blocks, requests
    from pagedlearn.models import load

    reqs = requests()
    loaded = load(model)
    llm = LLM(
        loaded,
        block_size=block_size,
        num_blocks=default_num_blocks(loaded.tokenizer, reqs, block_size),
        attention_backend="torch",
        device="cpu",
        verbose=False,
    )
    engine = llm.engine
    log = engine.record()
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if cancel_due(out):
                engine.abort_request("cancel")
    log.close()
    return log


def interleavings(state) -> int:
    """How often one request's physical blocks are split by another request's blocks.

    For each request (its samples or beams count as one), take the blocks its block tables point
    at in block-id order; every pair of neighbours with a block of *another* request between them
    counts one. Free blocks in between do not count: a gap is not a neighbour. 0 means every
    request sits in one run of ids, as it would under contiguous allocation; paging makes it
    grow, because a request that needs a new block gets whichever block the free queue hands
    out, wherever that is.

    >>> from pagedlearn.viz.state import build_state
    >>> # a: blocks 0, 1, 3; b: block 2 -- a is split by b once; b sits between a's, not split
    >>> interleavings(build_state(5, 4, {"a": [0, 1, 3], "b": [2]}, {}, {}, {}, {}))
    1
    """
    holders = [{state.group_of(s) for s in b.owners} for b in state.blocks]
    count = 0
    for group in set().union(*holders):
        ids = [i for i, h in enumerate(holders) if group in h]
        for lo, hi in pairwise(ids):
            count += any(holders[i] and group not in holders[i] for i in range(lo + 1, hi))
    return count


def headline_frame(frames):
    """The frame worth the README's first pictures: the one that shows what paging buys.

    A picture of a paged pool should show two things that one contiguous region per request
    does not allow: one request's blocks scattered among other requests' (:func:`interleavings`),
    and one block reached from several block tables (shared blocks, refcount > 1: a prefix-cache
    hit, a fork). So the score is their sum; ties go to the fullest pool (fewest free blocks),
    then to the frame holding the most tokens (a block just handed out holds one token, a bar too
    thin to see), then to the earliest.
    ``frames``: ``[(event index, PoolState), ...]`` as :func:`~pagedlearn.viz.replay_states`
    gives them.

    A fresh pool hides scattering: the free queue hands never-used blocks out in id order, so
    early allocations come out as runs of consecutive ids. Scattering appears once requests have
    finished or been preempted and their freed blocks are handed out again: one at a time to
    requests whose tokens fill their last block, and to the prompts admitted next.
    """
    from pagedlearn.viz.state import FREE, SHARED

    def score(frame):
        state = frame[1]
        return (
            interleavings(state) + state.count(SHARED),
            -state.count(FREE),
            sum(b.num_tokens for b in state.blocks),
        )

    return max(frames, key=score)  # max keeps the first of equal scores: the earliest


# A student's slip in the cow lab: the copy is made, but the writer keeps its reference on the
# shared block it copied from, so that block never returns to the pool.
COW_SLIP = ("self.allocator.free([src])  # one sharer fewer;", "pass  # forgot: one sharer fewer;")
COW_CHECK = "first_write_into_a_shared_partial_block_copies"


def lab_outcome():
    """The ``cow`` lab's check of a first write into a shared block, graded on :data:`COW_SLIP`
    exactly as a notebook would be: the check's outcome (its ``lines()``, its ``picture()``)."""
    import tempfile

    from pagedlearn.labs import get
    from pagedlearn.labs.handout import reference_source
    from pagedlearn.labs.runner import run_check
    from pagedlearn.labs.submission import load

    lab = get("cow")
    source = reference_source(lab.files[0])
    assert source.count(COW_SLIP[0]) == 1, "the slip no longer applies: update COW_SLIP"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kv_cache_manager.py"
        path.write_text(source.replace(*COW_SLIP))
        check = next(c for c in lab.checks if c.name == COW_CHECK)
        return run_check(check, load(lab, [path]))


def lab_feedback(outcome=None):
    """:func:`lab_outcome` as a student sees it: the lines ``check("cow")`` prints, above the
    picture it shows (the student's pool beside the reference's)."""
    import io
    import textwrap

    import matplotlib.image
    from matplotlib.figure import Figure

    outcome = outcome or lab_outcome()
    png = io.BytesIO()
    outcome.picture().savefig(png, format="png", dpi=100)
    picture = matplotlib.image.imread(io.BytesIO(png.getvalue()), format="png")
    head, *message = outcome.lines()  # as check("cow") prints them, wrapped to the picture
    text = [head, *textwrap.wrap(" ".join(message), 110, subsequent_indent="       ")]
    h_px, w_px = picture.shape[:2]
    text_h = 0.2 * len(text) + 0.2
    fig = Figure(figsize=(w_px / 100, h_px / 100 + text_h))
    fig.text(
        0.01,
        1 - 0.1 / (h_px / 100 + text_h),
        "\n".join(text),
        ha="left",
        va="top",
        family="monospace",
        fontsize=9,
    )
    ax = fig.add_axes((0, 0, 1, (h_px / 100) / (h_px / 100 + text_h)))
    ax.imshow(picture)
    ax.set_axis_off()
    return fig


def pool_data(state) -> dict:
    """What ``block_pool.png`` draws: the frame's step, block tables, each block's tokens and
    refcount, and the count of blocks per colour (used, shared, cached, free)."""
    from pagedlearn.viz.state import CACHED, FREE, SHARED, USED

    return {
        "step": state.step,
        "num_blocks": state.num_blocks,
        "tables": {str(seq): list(t) for seq, t in state.tables.items()},
        "num_tokens": [b.num_tokens for b in state.blocks],
        "refcount": [b.refcount for b in state.blocks],
        "counts": {k: state.count(k) for k in (USED, SHARED, CACHED, FREE)},
    }


def timeline_data(states) -> dict:
    """What ``memory_timeline.png`` draws: :func:`~pagedlearn.viz.timeline_rows` as columns (one
    list per key, one value per frame), and the totals its legend quotes."""
    from pagedlearn.viz import timeline_rows

    rows = timeline_rows(states)
    totals = ("evictions", "preemptions_recompute", "preemptions_swap")
    return {
        "steps": rows[-1]["step"],
        "frames": len(rows),
        **{k: sum(r[f"new_{k}"] for r in rows) for k in totals},  # the legend's counts
        "columns": {k: [r[k] for r in rows] for k in rows[0]},
    }


def own_figures(quick: bool = False, log=None, draw: bool = True) -> tuple[dict, dict]:
    """Our own figures (not the paper's): ``(figures, data)``, each by figure name.

    ``data``: the numbers each figure draws (what ``data.json`` keeps); ``draw=False`` computes
    only those (``figures`` is then empty), as the test does. ``log``: a recorded demo run to
    reuse (:func:`record_demo_run`; else one is recorded).
    """
    from pagedlearn.sim.workloads import paper_workload
    from pagedlearn.viz import fragmentation_breakdown, replay_states
    from pagedlearn.viz.fragmentation import reservation_vs_paging

    frames = replay_states(log if log is not None else record_demo_run())
    _, state = headline_frame(frames)
    states = [s for _, s in frames]
    few = paper_workload("sharegpt", 6, seed=1)
    step, strips = reservation_vs_paging(few, pool_slots=4096)
    outcome = lab_outcome()
    many = paper_workload("sharegpt", 120 if quick else 400, seed=0)
    breakdown = fragmentation_breakdown(many, pool_slots=8192)
    pool = pool_data(state)
    data = {
        "block_pool": pool,
        "block_tables": {k: pool[k] for k in ("step", "tables")},
        "memory_timeline": timeline_data(states),
        "reservation_vs_paging": {"pool_slots": 4096, "step": step, "strips": strips},
        "lab_feedback": {"lines": outcome.lines()},
        "fragmentation": {"num_requests": len(many), "pool_slots": 8192, "rows": breakdown},
    }
    if not draw:
        return {}, data
    from pagedlearn.viz import (
        draw_block_pool,
        draw_block_tables,
        draw_fragmentation,
        draw_memory_timeline,
        draw_reservation_vs_paging,
    )

    figures = {
        "block_pool": draw_block_pool(state, title=f"The physical KV blocks at step {state.step}"),
        "block_tables": draw_block_tables(state, title=f"Block tables at step {state.step}"),
        "memory_timeline": draw_memory_timeline(states),
        "reservation_vs_paging": draw_reservation_vs_paging(few, pool_slots=4096),
        "lab_feedback": lab_feedback(outcome),
        "fragmentation": draw_fragmentation(breakdown),
    }
    return figures, data


def make_figures(directory="figures", paper: bool = True, quick: bool = False, out=None):
    """Write every figure into ``directory``, and the numbers each draws into its
    ``data.json``; returns the PNG paths written.

    What is being done, and for how long, goes to stderr as it happens (the paper's part with
    its estimates, :mod:`pagedlearn.progress`); ``out`` gets what was written (stdout, flushed).
    """
    import sys
    from functools import partial

    from pagedlearn.progress import Stopwatch
    from pagedlearn.sim import plots

    out = out or partial(print, flush=True)
    note = partial(print, file=sys.stderr, flush=True)
    directory, watch = Path(directory), Stopwatch()
    parts = 2 if paper else 1
    note(f"figures 1/{parts}: serving the demo's mixed batch on {DEMO_MODEL} (recorded), "
         "simulating reservation vs paging on the same requests, a lab's feedback")  # fmt: skip
    figures, data = own_figures(quick)
    paths = plots.save_all(figures, directory, data)
    note(f"figures 1/{parts}: {len(paths)} figures in {watch}")
    if paper:
        from pagedlearn.sim.paper import report

        watch.note("figures 2/2: the paper's figures (python -m pagedlearn paper, its progress "
                   "below)")  # fmt: skip
        paths += report(quick=quick, out=lambda *_: None, figures_dir=directory)
    out("wrote " + ", ".join(str(p) for p in paths) + f" and {directory / plots.DATA} in "
        f"{watch}")  # fmt: skip
    return paths
