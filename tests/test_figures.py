"""``python -m pagedlearn figures``: every picture the README and notebooks show comes from code."""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path

from pagedlearn.cli.figures import headline_frame, interleavings, make_figures, record_demo_run
from pagedlearn.viz import replay_states
from pagedlearn.viz.state import SHARED, build_state

ROOT = Path(__file__).resolve().parents[1]
OWN = [
    "block_pool",
    "block_tables",
    "memory_timeline",
    "reservation_vs_paging",
    "lab_feedback",
    "fragmentation",
]


def test_figures_command_writes_the_block_pictures_the_same_way_twice(tmp_path):
    paths = make_figures(tmp_path / "a", paper=False, quick=True, out=lambda *_: None)
    assert sorted(p.stem for p in paths) == sorted(OWN)
    again = make_figures(tmp_path / "b", paper=False, quick=True, out=lambda *_: None)
    for p, q in zip(sorted(paths), sorted(again), strict=True):
        assert p.read_bytes() == q.read_bytes(), f"{p.name} differs between two runs"


def test_every_png_in_figures_is_made_by_the_command_and_documented():
    readme = (ROOT / "figures" / "README.md").read_text()
    pngs = sorted(p.name for p in (ROOT / "figures").glob("*.png"))
    assert {f"{name}.png" for name in OWN} <= set(pngs)
    for name in pngs:  # paper_*.png come from `python -m pagedlearn paper`, which it runs
        assert name in readme or (name.startswith("paper_") and "paper_*.png" in readme), name


def test_the_readme_shows_figures_that_exist():
    shown = re.findall(r"\]\((figures/[^)]+\.png)\)", (ROOT / "README.md").read_text())
    assert "figures/block_pool.png" in shown and "figures/reservation_vs_paging.png" in shown
    for path in shown:
        assert (ROOT / path).exists(), path


def _state(tables, step, num_blocks=8):
    info = {"step": step}
    return build_state(num_blocks, 4, tables, {}, {}, {}, {}, info)


def test_interleavings_count_a_request_split_by_another_not_by_free_blocks():
    assert interleavings(_state({"a.0": [0, 1, 2], "b.0": [3, 4]}, 0)) == 0  # two runs
    assert interleavings(_state({"a.0": [0, 1, 5], "b.0": [6]}, 0)) == 0  # a gap of free blocks
    assert interleavings(_state({"a.0": [0, 3], "b.0": [1, 4]}, 0)) == 2  # a|b|a|b: each split
    # the samples of one request are one request: a fork alone splits nothing
    assert interleavings(_state({"a.0": [0, 1], "a.1": [0, 2]}, 0)) == 0
    # block 0, shared, belongs to both; a's block 1 splits b's 0|2, b's block 2 splits a's 1|3
    assert interleavings(_state({"a.0": [0, 1, 3], "b.0": [0, 2]}, 0)) == 2


def test_the_headline_frame_scores_scattering_as_well_as_sharing():
    fork = _state({"a.0": [0, 1, 2], "a.1": [0, 1, 3]}, 1)  # 2 shared, 0 splits: score 2
    bigger_fork = _state({"a.0": [0, 1, 2, 3, 4], "a.1": [0, 1, 5]}, 2)  # score 2, fuller pool
    same_again = _state({"a.0": [0, 1, 2, 3, 4], "a.1": [0, 1, 5]}, 3)
    scattered = _state({"a.0": [0, 2, 4], "b.0": [1, 3]}, 4)  # 0 shared, 3 splits: score 3
    frames = list(enumerate([fork, bigger_fork, same_again]))
    assert headline_frame(frames)[1].step == 2  # equal scores: the fuller pool, then the earliest
    assert headline_frame([*frames, (3, scattered)])[1].step == 4


def test_the_readme_pictures_show_a_request_scattered_among_others_and_shared_blocks():
    """The frame `python -m pagedlearn figures` draws from the demo run shows paging: some
    request's block table is not a run of consecutive ids, and its blocks interleave with another
    request's; blocks are shared too. The README's caption names this step and these tables."""
    _, state = headline_frame(replay_states(record_demo_run()))
    jumps = {seq: [(a, b) for a, b in pairwise(t) if b != a + 1] for seq, t in state.tables.items()}
    scattered = [seq for seq, j in jumps.items() if j]
    assert scattered, f"every block table is a run of consecutive ids: {state.tables}"
    owner = {b.block_id: {state.group_of(s) for s in b.owners} for b in state.blocks}

    def interleaved(seq):  # another request owns a block between two of seq's blocks
        mine = state.group_of(seq)
        ids = sorted(state.tables[seq])
        return any(owner[i] - {mine} and mine not in owner[i] for i in range(ids[0], ids[-1]))

    assert any(interleaved(seq) for seq in scattered), state.tables
    assert interleavings(state) >= 3 and state.count(SHARED) >= 1
    see_it = (ROOT / "README.md").read_text().split("## See it")[1].split("\n## ")[0]
    assert f"at step {state.step}" in see_it, "the README's caption names another step"
    assert state.tables == {
        "chat-1.0": (0, 1, 2, 3, 4, 9),  # the caption: chat-1 owns 3, 4 and 9 ...
        "chat-2.0": (0, 1, 2, 5, 6, 8),
        "long.0": (*range(10, 30), 7),
    }, "the run changed: update the README's captions under '## See it'"
