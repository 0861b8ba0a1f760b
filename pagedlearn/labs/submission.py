"""Load a student's submission: one or more ``.py`` files, or a lab notebook, or the reference.

A submission is whatever defines the lab's names (``BlockAllocator``, ``BlockTable``, ...):

- ``.py`` files -- the handout's skeleton files, filled in (the package's own files load the same
  way, and get full marks);
- a lab notebook (``.ipynb``) -- its code cells run top to bottom in one namespace, as "Run all"
  would, except cells tagged ``demo`` (they run a model: nothing to grade there), and with
  ``check(...)`` switched off (``PAGEDLEARN_GRADING=1``), IPython magics and shell lines dropped.
  Only an error in an *exercise* cell (tagged ``exercise``: where the graded code is) stops the
  load; a cell that merely uses the code and fails (a stub, a drawing) is skipped, as the checks
  will find the same fault and say more about it;
- the reference (``--reference``) -- the package's own modules.

:func:`load` raises :class:`SubmissionError`, with a one-line message, when a file is missing,
does not parse, or raises while it is loaded.
"""

from __future__ import annotations

import importlib
import itertools
import json
import linecache
import os
import sys
import types
from pathlib import Path
from unittest import mock

from pagedlearn.labs.handout import EXERCISE_TAG
from pagedlearn.labs.lab import STUDENT_FILES, CheckFailed, Lab, student_line

GRADING_ENV = "PAGEDLEARN_GRADING"  # set while a notebook is loaded for grading: check() is off
DEMO_TAG = "demo"  # notebook cells that are not part of the submission
_LOADED = itertools.count()  # a fresh module name per load: two loads never share one


class SubmissionError(Exception):
    """The submission cannot be loaded; the message is one line, for the student."""


class Submission:
    """The names a submission defines, as attributes; a missing one is a check failure that says
    which name to define, not an ``AttributeError``."""

    def __init__(self, namespace: dict, origin: str) -> None:
        self._ns = namespace
        self._origin = origin

    def __getattr__(self, name: str):
        try:
            return self._ns[name]
        except KeyError:
            raise CheckFailed(f"{self._origin} does not define {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._ns

    def __repr__(self) -> str:
        return f"Submission({self._origin})"


def reference(lab: Lab) -> Submission:
    """The package's own code for ``lab``: its reference modules' names, merged."""
    ns: dict = {}
    for path in lab.files:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        ns.update(vars(module))
    return Submission(ns, "the reference")


def load(lab: Lab, paths: list[str | os.PathLike]) -> Submission:
    """Load ``paths`` (``.py`` files, or one ``.ipynb``) as a submission for ``lab``."""
    if not paths:
        raise SubmissionError("no submission given: name a .py file or a lab notebook")
    ns: dict = {}
    for p in map(Path, paths):
        if p.is_dir():
            raise SubmissionError(f"{p} is a folder: name the .py files or the notebook in it")
        if not p.exists():
            raise SubmissionError(f"{p}: no such file")
        if p.suffix == ".ipynb":
            ns.update(_load_notebook(p))
        elif p.suffix == ".py":
            ns.update(_load_py(p))
        else:
            raise SubmissionError(f"{p}: a submission is a .py file or a lab notebook (.ipynb)")
    missing = [n for n in lab.names if n not in ns]
    if len(missing) == len(lab.names):
        raise SubmissionError(
            f"{', '.join(map(str, paths))} defines none of the lab's names "
            f"({', '.join(lab.names)}): is it the right lab?"
        )
    return Submission(ns, " + ".join(Path(p).name for p in paths))


def _compile(source: str, filename: str):
    # Known to linecache, code from a notebook cell has source lines too: tracebacks and
    # student_line quote it, and Triton (which reads a @triton.jit function's source) accepts it.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    try:
        return compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise SubmissionError(f"{filename}, line {e.lineno}: SyntaxError: {e.msg}") from None
    except ValueError as e:  # e.g. null bytes
        raise SubmissionError(f"{filename}: cannot be read as Python: {e}") from None


def _run(code, ns: dict, filename: str) -> None:
    STUDENT_FILES.add(filename)
    try:
        exec(code, ns)
    except NotImplementedError:
        raise  # a stub called at load time is the notebook's business, not a load error
    except BaseException as e:  # SystemExit too: a submission must not end the grader
        if isinstance(e, KeyboardInterrupt):
            raise
        where = student_line(e) or f" (in {filename})"
        raise SubmissionError(
            f"loading it raised {type(e).__name__}: {e}{where}".replace("\n", " ")
        ) from None


def _load_py(path: Path) -> dict:
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SubmissionError(f"{path}: cannot be read: {e}") from None
    filename = str(path)
    code = _compile(source, filename)
    module = _new_module(path)
    _run(code, module.__dict__, filename)
    return module.__dict__


def _new_module(path: Path) -> types.ModuleType:
    """An empty module for a submission, under a name no other load uses, registered in
    ``sys.modules`` (dataclasses and pickling look classes up by their module's name)."""
    module = types.ModuleType(f"submission_{next(_LOADED)}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    return module


def notebook_cells(path: Path) -> list[tuple[str, str, bool]]:
    """``(filename, source, is_exercise)`` of each code cell that is part of the submission."""
    try:
        nb = json.loads(path.read_text())
        cells = nb["cells"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SubmissionError(f"{path}: not a readable notebook ({e})") from None
    out = []
    for i, cell in enumerate(cells, 1):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.get("cell_type") != "code" or DEMO_TAG in tags:
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
        out.append((f"{path.name}, cell {i}", "\n".join(lines) + "\n", EXERCISE_TAG in tags))
    return out


def _load_notebook(path: Path) -> dict:
    module = _new_module(path)
    with mock.patch.dict(os.environ, {GRADING_ENV: "1"}):  # check() is off; restored after
        for filename, source, is_exercise in notebook_cells(path):
            code = _compile(source, filename)
            try:
                _run(code, module.__dict__, filename)
            except (SubmissionError, NotImplementedError) as e:
                if is_exercise:
                    raise
                print(f"(skipped the rest of {filename}: {e})", file=sys.stderr)
    return module.__dict__


__all__ = ["GRADING_ENV", "Submission", "SubmissionError", "load", "reference"]
