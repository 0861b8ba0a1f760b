"""``python -m pagedlearn figures``: regenerate every PNG in ``figures/`` from the real code.

Nothing in ``figures/`` is drawn by hand. Each picture comes from a run of the project's own code,
seeded and offline, so that running the command twice gives the same pictures:

- ``block_pool.png``, ``block_tables.png``, ``memory_timeline.png``: the demo's mixed batch
  (:mod:`pagedlearn.demo`: chats sharing a system prompt, parallel sampling, beam search, a
  cancelled request, preemption) served by the engine on the offline ``tiny-gpt2`` with the
  PyTorch attention backend, recorded, and drawn from the recording at the step with the most
  shared blocks (the replay draws exactly what the live view showed);
- ``reservation_vs_paging.png``, ``fragmentation.png``: the same requests under max-length
  contiguous reservation and under paging, on the simulator with the real ``KVCacheManager``;
- ``paper_*.png``, ``prefix_caching.png``: the paper's memory figures (``python -m pagedlearn
  paper``), unless ``--no-paper``.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL = "tiny-gpt2"  # offline and seeded: the same weights, so the same run, everywhere


def record_demo_run(model: str = DEMO_MODEL, block_size: int = 16):
    """Serve the demo's requests on ``model`` and return the recorded ``EventLog``.

    Same requests and pool sizing as ``make demo``; the cancelled request is aborted when
    :func:`~pagedlearn.demo.cancel_due` says so, as there.
    """
    from pagedlearn import LLM
    from pagedlearn.demo import cancel_due, default_num_blocks, requests
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


def busiest_frame(frames):
    """The frame worth a picture: the most shared blocks, then the fullest pool."""
    from pagedlearn.viz.state import FREE, SHARED

    def score(frame):
        state = frame[1]
        return (state.count(SHARED), state.num_blocks - state.count(FREE))

    return max(frames, key=score)


def make_figures(directory="figures", paper: bool = True, quick: bool = False, out=print):
    """Write every figure into ``directory``; returns the paths written."""
    from pagedlearn.sim import plots
    from pagedlearn.sim.workloads import paper_workload
    from pagedlearn.viz import (
        draw_block_pool,
        draw_block_tables,
        draw_fragmentation,
        draw_memory_timeline,
        draw_reservation_vs_paging,
        fragmentation_breakdown,
        replay_states,
    )

    directory = Path(directory)
    out(f"serving the demo's mixed batch on {DEMO_MODEL} (recorded) ...")
    log = record_demo_run()
    frames = replay_states(log)
    _, state = busiest_frame(frames)
    figures = {
        "block_pool": draw_block_pool(state, title=f"The physical KV blocks at step {state.step}"),
        "block_tables": draw_block_tables(state, title=f"Block tables at step {state.step}"),
        "memory_timeline": draw_memory_timeline([s for _, s in frames]),
    }
    out("simulating reservation vs paging on the same requests ...")
    few = paper_workload("sharegpt", 6, seed=1)
    figures["reservation_vs_paging"] = draw_reservation_vs_paging(few, pool_slots=4096)
    many = paper_workload("sharegpt", 120 if quick else 400, seed=0)
    figures["fragmentation"] = draw_fragmentation(fragmentation_breakdown(many, pool_slots=8192))
    paths = plots.save_all(figures, directory)
    if paper:
        from pagedlearn.sim.paper import report

        out("recomputing the paper's memory figures (python -m pagedlearn paper) ...")
        paths += report(quick=quick, out=lambda *_: None, figures_dir=directory)
    out("wrote " + ", ".join(str(p) for p in paths))
    return paths
