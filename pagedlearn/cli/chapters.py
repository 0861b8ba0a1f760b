"""Run the chapters and keep their outputs, so that they can be read without running anything.

Reading groups read the chapters on GitHub or in a browser, often with no Python at hand. So
every ``notebooks/NN_*.ipynb`` is committed *with* its outputs: the text and pictures of one
seeded, offline run on a CPU (``PAGEDLEARN_OFFLINE=1``: the tiny random-weight models, the same
run CI makes). The ``.py`` twin stays the reviewed source; the ``.ipynb`` is the ``.py`` plus
what it printed and drew. ``make notebooks`` (``python -m pagedlearn.cli.chapters``) rewrites them,
and ``tests/test_notebooks.py`` runs every chapter again and fails when a committed output is
not what the code prints now (with the line to run).

A chapter runs for one of two reasons. :func:`write` runs it to *store* what a reader sees;
:func:`execute` alone (what the test does) runs it to *check* it, with ``PAGEDLEARN_CHECK=1`` in
its environment (:func:`checking` reads it). Since a check compares no ``timing`` output, a
chapter may run its timed sections small then (chapter 08 does: its benchmark takes minutes on a
busy two-core machine): the check proves they run, not how fast, and the outputs a reader sees
are the ones :func:`write` stored, at the sizes the chapter's prose discusses.

Two things would otherwise make every run a diff:

- **timings.** A cell whose output holds a measured time is tagged ``timing`` (in the ``.py``:
  ``# %% tags=["timing"]``). Its committed output is kept as long as the cell's source is
  unchanged, and the check skips it: the numbers are one machine's, and the chapter's prose
  says what to look for in them rather than what they are.
- **volatile metadata.** Cell ids are made from the cell's text (not at random); execution
  timestamps, the widget-view ids of ``ipywidgets`` (random on every run, and useless without
  a kernel -- our views also carry a PNG of their picture, which is what a reader without a
  kernel sees) and the kernel's saved widget state are dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
TIMING = "timing"  # the cell tag: "this output holds measured times"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
OFFLINE_ENV = {  # what a chapter is run under, here and in CI
    "PAGEDLEARN_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}
CHECK_ENV = {"PAGEDLEARN_CHECK": "1"}  # added when a chapter runs to be checked, not stored


def checking() -> bool:
    """True inside a chapter that runs to be checked (tests, CI: see the module docstring), where
    its ``timing`` cells may run small; False in JupyterLab and in ``make notebooks``."""
    return os.environ.get("PAGEDLEARN_CHECK") == "1"


def chapters(names=()) -> list[Path]:
    """The chapters' ``.py`` sources; ``names`` (e.g. ``["05", "07"]``) picks some by number."""
    found = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    if not names:
        return found
    picked = [p for p in found if p.stem[:2] in names or p.stem in names]
    unknown = set(names) - {p.stem[:2] for p in picked} - {p.stem for p in picked}
    if unknown:
        raise ValueError(
            f"no chapter {sorted(unknown)}; the chapters are {[p.stem for p in found]}"
        )
    return picked


def execute(py: Path, timeout: int = 300, check: bool = True):
    """Run chapter ``py`` top to bottom, offline, from ``notebooks/`` (as a student's JupyterLab
    would); returns the executed notebook. Raises ``CellExecutionError`` naming the cell.
    ``check``: run it to be checked (``PAGEDLEARN_CHECK=1``: timed sections may run small);
    :func:`write` passes False: the outputs it stores are the ones the prose discusses."""
    import jupytext
    import nbclient

    nb = jupytext.read(py)
    _convert_chat_model_first(py)
    env = {**OFFLINE_ENV, **CHECK_ENV} if check else OFFLINE_ENV
    saved = {k: os.environ.get(k) for k in (*OFFLINE_ENV, *CHECK_ENV)}
    for k in CHECK_ENV:  # unless asked for below: a stored run is full size
        os.environ.pop(k, None)
    os.environ.update(env)  # the kernel inherits them
    try:
        client = nbclient.NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            record_timing=False,
            store_widget_state=False,
            resources={"metadata": {"path": str(py.parent)}},
        )
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return clean(nb)


def runs_chat_model(py: Path) -> bool:
    """Whether chapter ``py`` loads the chat model (``env.chat``: SmolLM2 where its wheel is
    installed), whose outputs it stores."""
    return "env.chat" in py.read_text(encoding="utf-8")


def _convert_chat_model_first(py: Path) -> None:
    """SmolLM2 is converted from its wheel once per machine (pagedlearn.models.smollm2), and the
    conversion says so on stderr. Done inside a chapter, that line and its progress bar would be
    stored as the chapter's output on a fresh machine, or make a fresh CI machine's check fail;
    done here, they go to this terminal. A chapter that never loads SmolLM2 is not delayed, and a
    failed conversion is left for the chapter's own cell to report."""
    if not runs_chat_model(py):
        return
    from pagedlearn.models import ModelLoadError, smollm2

    if smollm2.installed():
        with contextlib.suppress(ModelLoadError):
            smollm2.folder()


def clean(nb):
    """Drop what changes on every run and means nothing to a reader (see the module docstring)."""
    nb.metadata.pop("widgets", None)
    seen: set[str] = set()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        # Cell ids from the content, not random: an unchanged cell keeps its id from run to run.
        digest = hashlib.sha1(f"{cell.cell_type}:{cell.source}".encode()).hexdigest()
        cell.id = next(digest[i : i + 8] for i in range(0, 33) if digest[i : i + 8] not in seen)
        seen.add(cell.id)
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.outputs:
            out.get("data", {}).pop(WIDGET_VIEW, None)
            last = outputs[-1] if outputs else None
            # print() flushes when the kernel pleases: the same text comes in one piece or in
            # several; joined, it reads (and compares) the same every run.
            if last and out.output_type == last.output_type == "stream" and out.name == last.name:
                last.text += out.text
            else:
                outputs.append(out)
        cell.outputs = outputs
    return nb


def is_timing(cell) -> bool:
    return TIMING in cell.metadata.get("tags", [])


def keep_committed_timings(new, old) -> int:
    """Give each ``timing`` cell of ``new`` the outputs it has in ``old`` (the committed
    notebook) when its source is unchanged; returns how many were kept."""
    committed = {c.source: c for c in old.cells if c.cell_type == "code" and is_timing(c)}
    kept = 0
    for cell in new.cells:
        before = committed.get(cell.source) if is_timing(cell) else None
        if before is not None and before.get("outputs"):
            cell.outputs = before.outputs
            kept += 1
    return kept


def readable(output) -> dict:
    """What a check compares of one output: its kind and text, and which formats it has
    (pictures by format only: PNG bytes change with the matplotlib and font versions)."""
    data = output.get("data", {})
    text = output.get("text") or data.get("text/plain") or data.get("text/markdown") or ""
    if output.get("output_type") == "error":
        text = f"{output.get('ename')}: {output.get('evalue')}"
    return {
        "type": output.get("output_type"),
        "name": output.get("name"),
        "formats": sorted(data),
        "text": "".join(text) if isinstance(text, list) else text,
    }


def stale_cells(fresh, committed) -> list[str]:
    """Where ``committed`` does not show what ``fresh`` printed: one line per differing code
    cell (``timing`` cells are skipped). Empty when the committed outputs are current."""
    problems = []
    new = [c for c in fresh.cells if c.cell_type == "code"]
    old = [c for c in committed.cells if c.cell_type == "code"]
    if [c.source for c in new] != [c.source for c in old]:
        return ["the code cells differ from the .py: run `make notebooks`"]
    for i, (a, b) in enumerate(zip(new, old, strict=True)):
        if is_timing(a):
            continue
        got = [readable(o) for o in a.get("outputs", [])]
        had = [readable(o) for o in b.get("outputs", [])]
        if got != had:
            first = a.source.strip().splitlines()[0][:60] if a.source.strip() else ""
            problems.append(
                f"code cell {i} ({first!r}): committed {had!r:.300} != now {got!r:.300}"
            )
    return problems


def write(py: Path, out=print) -> Path:
    """Run chapter ``py`` and store the run in its ``.ipynb`` twin (timings kept, see above)."""
    import jupytext

    ipynb = py.with_suffix(".ipynb")
    nb = execute(py, check=False)
    committed = _committed(ipynb)
    kept = keep_committed_timings(nb, committed) if committed is not None else 0
    jupytext.write(nb, ipynb)
    out(f"{ipynb.name}: outputs stored ({kept} timing cell(s) kept as committed)")
    return ipynb


def _committed(ipynb: Path):
    """The notebook as git's HEAD has it (what readers have), else as it is on disk, else None.
    Not simply the file: ``make notebooks`` runs ``jupytext --sync`` first, which writes an
    edited cell's new source into the .ipynb beside its old output, and that output would then
    look current to :func:`keep_committed_timings`."""
    import subprocess

    import jupytext

    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ipynb.parent,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        rel = ipynb.resolve().relative_to(Path(top).resolve()).as_posix()
        text = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=top, capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        return jupytext.reads(text, fmt="ipynb")
    except (OSError, ValueError, subprocess.CalledProcessError):  # no git, or a new chapter
        return jupytext.read(ipynb) if ipynb.exists() else None


def main(argv=None) -> int:
    names = sys.argv[1:] if argv is None else argv
    if any(a.startswith("-") for a in names):
        print("usage: python -m pagedlearn.cli.chapters [NN ...]  (run chapters, store outputs)")
        return 0 if {"-h", "--help"} & set(names) else 2
    try:
        todo = chapters(names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for py in todo:
        write(py)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
