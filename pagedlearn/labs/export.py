"""``python -m pagedlearn labs export DIR``: the student handout, with no solution in it.

The handout is one folder per lab, made from the package's own source::

    DIR/README.md                 how to work, check and grade (for students)
    DIR/01_allocator/01_allocator.ipynb     the lab notebook, exercise cells as stubs
    DIR/01_allocator/block_allocator.py     the reference files, the lab's bodies as stubs
    DIR/01_allocator/block_table.py
    ...
    DIR/pagedlearn-student/       the student edition of pagedlearn (student_edition.py)

Students install the student edition (``pip install -e pagedlearn-student``): the checks, the
pictures and the engine come from it. Every function a lab names is a stub in the notebook, the
``.py`` files and the student edition; :func:`export` checks that by parsing what it wrote, so a
solution cannot slip out.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pagedlearn.labs import all_labs
from pagedlearn.labs.handout import EXERCISE_TAG, _find, is_stub, lab_files
from pagedlearn.labs.student_edition import build

STUDENT_README = """\
# pagedlearn labs

Six labs, taken in order. In each you write part of PagedAttention -- the block pool, copy-on-write,
the prefix cache, the attention loop, the Triton kernel, the scheduler -- and the lab tells you
precisely what is wrong, then your code serves a real model.

{table}

## How to work

1. Install the student edition of pagedlearn, once, from this folder (in a fresh environment:
   it installs as `pagedlearn`, in place of a full one):

       pip install -e pagedlearn-student

   It is all of pagedlearn -- the engine, the models, the pictures, `check()` -- except that
   every function a lab grades is a stub until you write it, and whatever needs one says so by
   name: "BlockAllocator.allocate is lab 1, allocator: not written yet -- ...".
2. Open a lab's notebook (`jupyter lab`), read it, and fill in the exercise cells. Each ends with
   `check("...")`: run the cell, and read what it prints. The student edition has no reference
   to compare with, so `check()` asks your code the questions the grader asks and compares with
   the reference's answers, recorded when this folder was made: a failure names the operations
   that went wrong, what the reference answered and what your code did.
3. Prefer plain files? Each folder has the same code as `.py` files, with the same stubs; they are
   the package's own files (`pagedlearn-student/pagedlearn/core/block_allocator.py` ...), so you
   can also write your answers there directly, and the engine runs them at once.
4. The labs build on each other: the cow lab's manager takes its blocks from *your* lab 1
   allocator, and its prefix-caching checks need your lab 3 prefix cache (they say so by name
   until you have written it; your instructor's grader runs them on the package's own). Keep your
   answers of earlier labs in the package's files, or name their files when you grade.

## How to grade yourself (as your instructor will)

    python -m pagedlearn grade allocator 01_allocator/01_allocator.ipynb
    python -m pagedlearn grade allocator 01_allocator/block_allocator.py 01_allocator/block_table.py
    python -m pagedlearn grade cow 01_allocator/*.py 02_cow/kv_cache_manager.py 03_prefix/*.py

Exit status 0: every check passed; 1: some failed; 2: the submission could not be loaded.
Your instructor's grader is stricter than this one: it runs its checks with the reference, and
draws random cases this recording does not hold; an exercise whose functions your submission
imports or copies from pagedlearn gets 0 points there.
Submit what your instructor asks for: the notebook, or the `.py` files.
"""


def export(out_dir: str | Path) -> list[Path]:
    """Write the handout into ``out_dir`` (created; files in it are overwritten); returns the
    files written."""
    import jupytext

    from pagedlearn.cli.chapters import clean
    from pagedlearn.labs.notebooks import fill_exercises, lab_notebook

    out = Path(out_dir)
    written: list[Path] = []
    rows = ["| Lab | Files | What you build | Chapter |", "|---|---|---|---|"]
    for lab in all_labs():
        folder = out / f"{lab.number:02d}_{lab.id}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, source in lab_files(lab, blank=True).items():
            path = folder / name
            path.write_text(source)
            written.append(path)
        nb_path = lab_notebook(lab.id)
        if nb_path.exists():
            nb = jupytext.read(nb_path)
            fill_exercises(nb, lab.id, blank=True)
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
            _check_cells_are_stubs(nb, lab)
            path = folder / f"{nb_path.stem}.ipynb"
            jupytext.write(clean(nb), path, fmt="ipynb")
            written.append(path)
        files = ", ".join(f"`{Path(f).name}`" for f in lab.files)
        rows.append(f"| {lab.number}. `{lab.id}` | {files} | {lab.title} | {lab.chapter} |")
    readme = out / "README.md"
    readme.write_text(STUDENT_README.format(table="\n".join(rows)))
    written.append(readme)
    _check_no_solutions(out)
    edition = build(out / "pagedlearn-student")  # verifies its own stubs
    written.extend(p for p in sorted(edition.rglob("*")) if p.is_file())
    return written


def _check_no_solutions(out: Path) -> None:
    """Every target in every handout file is a stub (a safety net for the instructor)."""
    for lab in all_labs():
        folder = out / f"{lab.number:02d}_{lab.id}"
        for path in folder.glob("*.py"):
            tree = ast.parse(path.read_text())
            for ex in lab.exercises:
                for qualname in ex.targets:
                    try:
                        fn = _find(tree, qualname)
                    except LookupError:
                        continue
                    if not is_stub(fn):
                        raise AssertionError(f"{path}: {qualname} is not a stub")


def _check_cells_are_stubs(nb, lab) -> None:
    """Every function an exercise cell defines under a target's name is a stub."""
    names = {q.split(".")[-1] for ex in lab.exercises for q in ex.targets}
    for cell in nb.cells:
        if cell.cell_type != "code" or EXERCISE_TAG not in cell.metadata.get("tags", []):
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.FunctionDef) and node.name in names and not is_stub(node):
                raise AssertionError(f"{lab.id}: the notebook's {node.name} is not a stub")
