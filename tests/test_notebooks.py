"""The chapters: each .ipynb matches its reviewed .py twin, follows the chapter layout, and runs.

CI executes every notebook top to bottom on a CPU, offline (``PAGEDLEARN_OFFLINE=1``: the tiny
models), from the ``notebooks/`` folder, as a student's JupyterLab would. ``pytest --durations=0
tests/test_notebooks.py`` prints how long each one takes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
TIMEOUT_S = 300  # per cell; a chapter takes well under a minute on two CPU cores


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_eight_chapters_each_a_pair():
    assert [p.stem[:2] for p in CHAPTERS] == [f"{i:02d}" for i in range(1, 9)]
    ipynbs = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    assert ipynbs == [p.stem for p in CHAPTERS], "every chapter needs both .py and .ipynb"


@pytest.mark.parametrize("py", CHAPTERS, ids=lambda p: p.stem)
def test_pair_is_in_sync(py: Path):
    ipynb = py.with_suffix(".ipynb")
    if not ipynb.exists():
        pytest.fail(f"{ipynb.name} is missing: run `make notebooks`")
    a, b = _cells(jupytext.read(py)), _cells(jupytext.read(ipynb))
    assert a == b, f"{py.name} and {ipynb.name} differ: run `make notebooks` (jupytext --sync)"
    # Checked in without outputs: diffs stay readable and nothing stale is shown.
    nb = nbformat.read(ipynb, as_version=4)
    stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("outputs")]
    assert not stale, f"{ipynb.name} has outputs in cells {stale}: clear them before committing"


@pytest.mark.parametrize("py", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_layout(py: Path):
    cells = jupytext.read(py).cells
    first = cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(f"# {py.stem[:2]} ")
    assert "What you will learn" in first.source and "What you need" in first.source
    code = [c for c in cells if c.cell_type == "code"]
    assert "setup()" in code[0].source, "the first code cell runs pagedlearn.notebook.setup()"
    last_md = [c for c in cells if c.cell_type == "markdown"][-1].source
    if py.stem.startswith("08") and "placeholder" in last_md.lower():
        return
    assert "## Exercises" in last_md, "a chapter ends with exercises"
    exercises = re.findall(r"^\d+\.\s", last_md.split("## Exercises", 1)[1], flags=re.M)
    assert 2 <= len(exercises) <= 4, f"{len(exercises)} exercises; a chapter has 2-4"
    for c in code:  # notebooks import the package; they do not redefine it
        assert not re.search(r"^\s*class \w+", c.source, flags=re.M), "a class in a notebook"


@pytest.mark.parametrize("py", CHAPTERS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_offline(py: Path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PAGEDLEARN_OFFLINE", "1")  # the kernel inherits these
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = jupytext.read(py)
    client = nbclient.NotebookClient(
        nb, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # A chapter that draws must show pictures, not "<Figure size 640x480 with 1 Axes>".
    draws = any(
        "draw_" in c.source or "plot_" in c.source for c in nb.cells if c.cell_type == "code"
    )
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images or not draws, "the chapter draws figures but none was shown as an image"


def test_setup_asks_the_hub_once_and_falls_back_to_the_tiny_models(monkeypatch):
    from pagedlearn import notebook
    from pagedlearn.models import hub

    asked = []
    monkeypatch.delenv("PAGEDLEARN_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "in_cache", lambda name: name == "facebook/opt-125m")
    monkeypatch.setattr(hub, "why_unreachable", lambda: asked.append(1) or "no network")
    env = notebook.setup(verbose=False)
    assert (env.gpt2, env.opt, env.offline) == ("tiny-gpt2", "facebook/opt-125m", True)
    monkeypatch.setattr(hub, "in_cache", lambda name: False)
    env = notebook.setup(verbose=False)
    assert (env.gpt2, env.opt) == ("tiny-gpt2", "tiny-opt")
    assert len(asked) == 2  # once per setup(), not once per model
