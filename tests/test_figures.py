"""``python -m pagedlearn figures``: every picture the README and notebooks show comes from code."""

from __future__ import annotations

import re
from pathlib import Path

from pagedlearn.figures import busiest_frame, make_figures

ROOT = Path(__file__).resolve().parents[1]
OWN = ["block_pool", "block_tables", "memory_timeline", "reservation_vs_paging", "fragmentation"]


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


def test_the_picture_is_taken_where_the_most_blocks_are_shared():
    class S:
        def __init__(self, shared, free):
            self.num_blocks, self._c = 10, {"shared": shared, "free": free}

        def count(self, kind):
            return self._c[kind]

    frames = [(0, S(1, 2)), (1, S(3, 9)), (2, S(3, 5)), (3, S(0, 0))]
    assert busiest_frame(frames)[0] == 2
