"""``python -m pagedlearn figures``: every picture the README and notebooks show comes from code."""

from __future__ import annotations

import io
import json
import math
import re
from itertools import pairwise
from pathlib import Path

import pytest

from pagedlearn.cli.figures import (
    MEASURED,
    headline_frame,
    interleavings,
    make_figures,
    own_figures,
    record_demo_run,
)
from pagedlearn.sim.plots import DATA
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


@pytest.fixture(scope="module")
def demo_log():
    return record_demo_run()  # a few seconds: recorded once for the tests that read it


def test_figures_command_writes_the_block_pictures_the_same_way_twice(tmp_path, demo_log):
    """The command's pictures and their numbers; a second run (drawn from the demo run the
    other tests share, not recorded again) writes the same bytes."""
    paths = make_figures(tmp_path, paper=False, quick=True, out=lambda *_: None)
    assert sorted(p.stem for p in paths) == sorted(OWN)
    written, saved = json.loads((tmp_path / DATA).read_text()), committed()
    assert sorted(written) == sorted(OWN)
    assert written["fragmentation"]["num_requests"] == 120  # --quick: a smaller simulation
    for name in set(OWN) - {"fragmentation"}:  # the rest is --quick or not
        assert_same(name, written[name], saved[name])
    again, _ = own_figures(quick=True, log=demo_log)
    for path in paths:
        png = io.BytesIO()
        again[path.stem].savefig(png, format="png", dpi=120)  # as plots.save_all does
        assert png.getvalue() == path.read_bytes(), f"{path.name} differs between two runs"


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


def test_the_readme_pictures_show_a_request_scattered_among_others_and_shared_blocks(demo_log):
    """The frame `python -m pagedlearn figures` draws from the demo run shows paging: some
    request's block table is not a run of consecutive ids, and its blocks interleave with another
    request's; blocks are shared too. The README's caption names this step and these tables."""
    _, state = headline_frame(replay_states(demo_log))
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


# -- figures/data.json: the committed figures' numbers are what the code computes now ----------

REGENERATE = "run `make figures` (python -m pagedlearn figures) and commit figures/"


def committed() -> dict:
    return json.loads((ROOT / "figures" / DATA).read_text())


def same(ours, theirs, where="") -> list[str]:
    """Where ``ours`` (recomputed) and ``theirs`` (committed) differ: exactly, but floats to 1e-9
    relative (the same sum on another platform may round its last bit differently)."""
    if isinstance(ours, float) or isinstance(theirs, float):
        ok = isinstance(ours, (int, float)) and isinstance(theirs, (int, float))
        return [] if ok and math.isclose(ours, theirs, rel_tol=1e-9, abs_tol=1e-12) else [where]
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if ours.keys() != theirs.keys():
            return [f"{where} keys {sorted(ours)} != {sorted(theirs)}"]
        return [d for k in ours for d in same(ours[k], theirs[k], f"{where}.{k}")]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [
            d
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for d in same(a, b, f"{where}[{i}]")
        ]
    return [] if ours == theirs else [f"{where}: now {ours!r}, committed {theirs!r}"]


def assert_same(name, ours, theirs):
    ours = json.loads(json.dumps(ours))  # as data.json holds it: tuples as lists, keys strings
    diffs = same(ours, theirs, name)
    assert not diffs, f"{name}.png shows other numbers than the code makes now ({REGENERATE}): " + (
        "; ".join(diffs[:5])
    )


def test_every_committed_figure_has_its_numbers_in_data_json():
    pngs = {p.stem for p in (ROOT / "figures").glob("*.png")}
    assert set(committed()) == pngs, f"figures/{DATA} and the PNGs disagree: {REGENERATE}"


def test_our_figures_show_what_the_code_computes_now(demo_log):
    """The six figures of our own code, recomputed whole without drawing (about 2 s past the
    demo run the other tests share): the demo's pool, tables and timeline, the reservation
    strip, the lab's feedback and the fragmentation bars."""
    _, data = own_figures(log=demo_log, draw=False)
    saved = committed()
    assert sorted(data) == sorted(OWN)
    for name, ours in data.items():
        assert_same(name, ours, saved[name])


def _rows(saved, **match):
    return [r for r in saved if all(r[k] == v for k, v in match.items())]


def test_the_paper_figures_show_what_the_simulator_computes_now():
    """The paper's memory figures take about two minutes at full size; a few of their rows,
    recomputed at the sizes data.json records, take about 3 s and move with any change to the
    simulator, the allocator or the workloads. The rows of different figures share runs (cached)."""
    from pagedlearn.sim import paper, prefix, sharing

    saved = committed()
    fig2 = saved["paper_fig2_memory_breakdown"]
    for row in paper.figure2(fig2["workload"], fig2["num_requests"], systems=("oracle",)):
        assert_same("paper_fig2_memory_breakdown", row, _rows(fig2["rows"], system="oracle")[0])
    fig13 = saved["paper_fig13_batch_size"]
    for workload, system in (("sharegpt", "oracle"), ("alpaca", "vllm")):
        n = fig13["num_requests"][workload]
        (row,) = paper.figure13(workload, n, systems=(system,))
        assert_same("paper_fig13_batch_size", row, _rows(fig13["rows"][workload], system=system)[0])
    fig18b = saved["paper_fig18b_block_size"]
    n = fig18b["num_requests"]["alpaca"]
    (row,) = paper.figure18b("alpaca", block_sizes=(16,), num_requests=n)  # the run above
    assert_same("paper_fig18b_block_size", row, _rows(fig18b["rows"]["alpaca"], block_size=16)[0])
    spread = saved["paper_spread_sensitivity"]
    n = spread["num_requests"]
    (row,) = paper.spread_sensitivity(
        spread["workload"], (0.5,), num_requests=n, systems=("oracle",)
    )
    assert_same(
        "paper_spread_sensitivity", row, _rows(spread["rows"], spread=0.5, system="oracle")[0]
    )
    fig15 = saved["paper_fig15_sharing"]
    for row in sharing.figure15(("alpaca",), (2,), num_requests=fig15["num_requests"]):
        theirs = _rows(fig15["rows"], workload="alpaca", mode=row["mode"], width=2)[0]
        assert_same("paper_fig15_sharing", row, theirs)
    caching = saved["prefix_caching"]
    assert caching["quick"] is False
    for row in prefix.prefix_caching("multi-turn", 120):  # the few-chats stream, as drawn
        theirs = _rows(caching["rows"], stream=row["stream"], cache=row["cache"])[0]
        assert_same("prefix_caching", row, theirs)


def test_the_measured_figures_keep_their_layout_and_only_timings_move():
    """Figures 19 and 12 are timed on the machine that made them: their ``measured`` entries are
    not compared. Figure 19's block layout is: the block sizes, blocks and bytes it moved."""
    from types import SimpleNamespace

    import torch
    from transformers import GPT2Config

    from pagedlearn.models.runner import kv_cache_spec
    from pagedlearn.sim import swap_recompute

    saved = committed()
    fig19 = saved["paper_fig19_swap_recompute"]
    assert fig19["model"] == swap_recompute.GPT2_SIZE_RANDOM  # GPT-2 small's shape, float32
    per_token = kv_cache_spec(SimpleNamespace(config=GPT2Config(), dtype=torch.float32))
    rows = swap_recompute.layout(swap_recompute.BLOCK_SIZES, fig19["num_tokens"],
                                 per_token.bytes_per_token)  # fmt: skip
    assert fig19["num_tokens"] == swap_recompute.NUM_TOKENS
    assert_same("paper_fig19_swap_recompute", rows, fig19["rows"])
    measured = fig19[MEASURED]
    assert [r["block_size"] for r in measured] == list(swap_recompute.BLOCK_SIZES)
    assert all(tuple(r) == swap_recompute.FIELDS + swap_recompute.SPREADS for r in measured)
    assert set(saved["paper_fig12_latency"][MEASURED]) == {"rows", "summary"}


def test_figure19_times_every_block_size_after_a_warm_up_in_shuffled_rounds(monkeypatch):
    """The same conditions for every block size: each call is made once before any is timed,
    and each round times every block size once, in an order shuffled anew (seeded)."""
    from pagedlearn.sim import swap_recompute

    seen, real = [], swap_recompute.swap_per_block

    def spy(cache, pairs, direction):
        seen.append((cache.block_size, direction))
        real(cache, pairs, direction)

    monkeypatch.setattr(swap_recompute, "swap_per_block", spy)
    rows = swap_recompute.measure((1, 4, 16), num_tokens=32, repeats=4)
    assert [r["block_size"] for r in rows] == [1, 4, 16]
    sizes = [bs for bs, d in seen if d == "out"]
    assert len(sizes) == 3 + 3 * 4 and sizes[:3] == [1, 4, 16]  # the warm-up, then 4 rounds
    rounds = [tuple(sizes[3 + 3 * i : 6 + 3 * i]) for i in range(4)]
    assert all(sorted(r) == [1, 4, 16] for r in rounds), rounds
    assert len(set(rounds)) > 1, f"every round ran in the same order: {rounds}"
