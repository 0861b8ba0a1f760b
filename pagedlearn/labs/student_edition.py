"""The student edition: all of pagedlearn, with every function a lab grades left to write.

A student installs it (``pip install -e pagedlearn-student``; ``labs export`` writes it) and gets
the engine, the models, the pictures and ``check()`` -- everything but the answers. Each function
any lab grades has its body replaced, the same ``ast`` blanking as the handouts (handout.py:
signature and docstring kept), by a stub that says what needs it, by name::

    raise NotImplementedError("KVCacheManager.fork is lab 2, cow: not written yet -- make ...")

so a model that runs on the student's half-written pool stops at the first missing function and
names it, instead of a bare ``NotImplementedError`` deep in a traceback.

Nothing in the tree carries the reference: only source files are copied (never ``__pycache__``,
bytecode, built extensions, pickles or an ``.egg-info``), the notebooks stay out (their outputs
and cells hold the reference's code), and :func:`build` parses every lab file it wrote to check
that each target is a stub before it returns. A function no lab grades that holds a lab's answer
all the same (the prefill kernel's loop is lab 5's) is withheld the same way (:data:`WITHHELD`).
A file ``pagedlearn/labs/edition.py`` marks the tree (:func:`is_student_edition`).

The grader uses the same tree: :func:`edition_for_grading` builds it once per version of the
package's sources, into the cache folder, and the worker that runs a submission has only it on
its path -- the student's code can call the package, never the reference.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pagedlearn.labs.handout import ROOT, _defined_in, _find, blank_source, is_stub

PACKAGES = ("pagedlearn", "kernels")  # the import packages pyproject.toml installs
# Files copied beside the .py files: text data a module may read. Anything else (bytecode, a
# built extension, a pickle, a notebook) could carry the reference, so it is never copied.
DATA_SUFFIXES = (".json", ".txt", ".css", ".js", ".html", ".typed")
MARKER = Path("pagedlearn/labs/edition.py")  # exists only in a student edition
MARKER_TEXT = '''\
"""This copy of pagedlearn is the STUDENT EDITION: every function a lab grades is a stub here,
until you write it. Written by pagedlearn/labs/student_edition.py (``labs export``, the grader)."""

SOURCES_SHA256 = {digest!r}  # of the package it was made from
'''


def is_student_edition() -> bool:
    """Whether this pagedlearn is a student edition (built by :func:`build`), not the reference."""
    return (ROOT / MARKER).is_file()


# --- which files go in, and which bodies are blanked ---------------------------------------------
def source_files() -> list[Path]:
    """The files of the package that go into an edition, relative to the root, sorted."""
    out = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            rel = path.relative_to(ROOT)
            skipped = any(p == "__pycache__" or p.endswith(".egg-info") for p in rel.parts)
            if path.is_file() and not skipped and path.suffix in (".py", *DATA_SUFFIXES):
                out.append(rel)
    return sorted(out)


def sources_digest(files: list[Path]) -> str:
    """SHA-256 of the files' names and contents: a new version of the package, a new edition."""
    sha = hashlib.sha256()
    for rel in files:
        data = (ROOT / rel).read_bytes()
        sha.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        sha.update(data)
    return sha.hexdigest()


# Functions no lab grades that hold a lab's answer all the same: the student edition withholds
# them, stubbed like a graded one. The prefill kernel's tile loop is lab 5's _attend_tile with a
# causal mask; its wrapper goes too, so that a call says why by name instead of failing to
# compile on a GPU (a Triton kernel cannot raise).
NO_KERNEL = "its tile loop is lab 5's answer (kernel); here, use attention_backend='torch'"
WITHHELD = {
    "kernels/prefix_prefill.py": {
        "_paged_prefill_kernel": NO_KERNEL,
        "paged_attention_prefill": NO_KERNEL,
    },
}


def graded(lab_id: str | None = None) -> dict[str, dict[str, str]]:
    """``{file: {qualname: stub message}}``: every function any lab grades (or lab ``lab_id``
    only), where it is defined, and the :data:`WITHHELD` ones (for lab 5's edition too). A
    function named by two labs is stubbed as the earlier lab's."""
    from pagedlearn.labs import all_labs

    out: dict[str, dict[str, str]] = {}
    for lab in all_labs():
        if lab_id is not None and lab.id != lab_id:
            continue
        for ex in lab.exercises:
            for qualname, task in ex.targets.items():
                found = [p for p in lab.files if _defined_in(_read(p), qualname)]
                if not found:
                    raise LookupError(f"lab {lab.id!r}: {qualname!r} is in none of {lab.files}")
                for path in found:
                    message = f"{qualname} is lab {lab.number}, {lab.id}: not written yet -- {task}"
                    out.setdefault(path, {}).setdefault(qualname, message)
    for path, targets in WITHHELD.items() if lab_id in (None, "kernel") else ():
        for qualname, why in targets.items():
            message = f"{qualname} is withheld from the student edition: {why}"
            out.setdefault(path, {}).setdefault(qualname, message)
    return out


def _read(path: str) -> str:
    return (ROOT / path).read_text()


def blanked(path: str, targets: dict[str, str]) -> str:
    """The file ``path`` with each target's body a stub raising its message."""
    source = _read(path)
    for qualname, message in targets.items():
        # blank_source's stub raises "<who>: <task>"; here <who> names the function and the lab.
        who, task = message.split(": ", 1)
        source = blank_source(source, {qualname: task}, who)
    return source


# --- writing a tree ------------------------------------------------------------------------------
def _write_tree(dest: Path, files: list[Path], digest: str, lab_id: str | None = None) -> None:
    """The packages into ``dest`` (an empty folder), graded bodies blanked (of every lab, or of
    lab ``lab_id``), then the marker; raises AssertionError if a graded function is not a stub
    there (see :func:`verify`)."""
    stubs = graded(lab_id)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        key = rel.as_posix()
        if key in stubs:
            target.write_text(blanked(key, stubs[key]))
        else:
            shutil.copyfile(ROOT / rel, target)  # contents only: no metadata, no permissions
    (dest / MARKER).write_text(MARKER_TEXT.format(digest=digest))
    verify(dest, stubs)


def verify(dest: Path, stubs: dict[str, dict[str, str]] | None = None) -> None:
    """Raise AssertionError, naming the file and the function, unless every graded function in
    the tree at ``dest`` is a stub and the tree holds no bytecode, built extension or pickle."""
    stubs = graded() if stubs is None else stubs
    for path, targets in stubs.items():
        tree = ast.parse((dest / path).read_text())
        for qualname in targets:
            if not is_stub(_find(tree, qualname)):
                raise AssertionError(f"{dest / path}: {qualname} is not a stub")
    for path in dest.rglob("*"):
        if path.name == "__pycache__" or path.suffix in (".pyc", ".pyo", ".so", ".pkl", ".pt"):
            raise AssertionError(f"{path}: a student edition holds source files only")


HYPOTHESIS = "hypothesis>=6.100"  # the labs' checks need it (the full package's [labs] extra)


def _pyproject() -> str:
    """The repository's pyproject.toml, with hypothesis made a plain dependency (the student
    edition is for the labs: one install gives ``check()``); from an installed pagedlearn, which
    has no project file, one made from its metadata."""
    path = ROOT / "pyproject.toml"
    head = "\ndependencies = [\n"
    text = path.read_text() if path.is_file() else ""
    if head not in text:
        return _pyproject_from_metadata()
    return text.replace(head, f"{head}    {json.dumps(HYPOTHESIS)},  # the labs' checks\n", 1)


PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "pagedlearn"
version = {version}
readme = "README.md"
requires-python = {python}
dependencies = [
{deps}]

[project.scripts]
pagedlearn = "pagedlearn.__main__:main"

[tool.setuptools.packages.find]
include = ["pagedlearn*", "kernels*"]
"""


def _pyproject_from_metadata() -> str:
    from importlib import metadata

    meta = metadata.metadata("pagedlearn")
    needs = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return PYPROJECT.format(  # a JSON string is a TOML string
        version=json.dumps(meta["Version"]),
        python=json.dumps(meta["Requires-Python"] or ">=3.10"),
        deps="".join(f"    {json.dumps(r)},\n" for r in [*needs, HYPOTHESIS]),
    )


def _readme() -> str:
    from pagedlearn.labs import all_labs

    rows = ["| Lab | Write these | In |", "|---|---|---|"]
    for lab in all_labs():
        names = ", ".join(f"`{q}`" for ex in lab.exercises for q in ex.targets)
        files = ", ".join(f"`{f}`" for f in lab.files)
        rows.append(f"| {lab.number}. `{lab.id}` | {names} | {files} |")
    return STUDENT_EDITION_README.format(table="\n".join(rows))


STUDENT_EDITION_README = """\
# pagedlearn, student edition

All of pagedlearn -- the engine, the models, the pictures, `check()` in the lab notebooks --
except the functions the labs have you write. Install it once, from the folder that holds it:

    pip install -e pagedlearn-student

(It installs as `pagedlearn`, in place of a full pagedlearn in the same environment.)

Every function a lab grades is a stub here until you write it; whatever needs one says so by
name, e.g. `BlockAllocator.allocate is lab 1, allocator: not written yet -- ...`.

{table}
"""


def build(out_dir: str | Path, record: bool = True) -> Path:
    """Write an installable student edition at ``out_dir`` (``pyproject.toml``, ``README.md``,
    the packages with every graded body a stub, and -- ``record`` -- the reference's recorded
    answers to every check, which its ``check()`` and ``grade`` replay: expected.py) and
    return it.

    ``out_dir`` must not exist, or be a student edition written before (it is replaced whole, so
    no file of an older version stays behind); anything else there is refused, untouched. Raises
    AssertionError, writing nothing, if a graded function would not be a stub (:func:`verify`)."""
    out = Path(out_dir).resolve()
    if out.exists() and not (out / MARKER).is_file():
        raise FileExistsError(
            f"{out} exists and is not a student edition: remove it, or name a new folder"
        )
    files = source_files()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        _write_tree(tmp, files, sources_digest(files))
        if record:  # about 40 s: every lab's checks, graded on the reference through the sandbox
            from pagedlearn.labs import LAB_IDS, expected

            for lab_id in LAB_IDS:
                expected.write(tmp / "pagedlearn" / "labs" / "expected", lab_id)
        (tmp / "pyproject.toml").write_text(_pyproject())
        (tmp / "README.md").write_text(_readme())
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a leftover on failure
    return out


def _publish(tmp: Path, dest: Path) -> None:
    """Rename the finished tree ``tmp`` to ``dest``: other processes see no tree, or a whole one."""
    tmp.chmod(0o755)  # mkdtemp makes it private; a grader's unprivileged worker must read it
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)


# --- the grader's copy ---------------------------------------------------------------------------
def edition_for_grading(lab_id: str | None = None) -> Path:
    """The edition the grader's worker imports (its root goes first on ``sys.path``): with
    ``lab_id``, the package with that lab's graded bodies (only) blanked -- a cow submission
    runs on the package's allocator, as the lab is meant to, but never on its own answers --
    else the student edition. Built once per version of the package's sources, into the cache
    folder (``$PAGEDLEARN_CACHE``, else ``$XDG_CACHE_HOME/pagedlearn``, else
    ``~/.cache/pagedlearn``), as ``student-edition[-<lab>]-<sha256 of the sources>``. No project
    file, no README: only the packages."""
    from filelock import FileLock  # (huggingface_hub's own lock; transformers requires it)

    from pagedlearn.models.smollm2 import cache_root

    files = source_files()
    digest = sources_digest(files)
    lab = f"-{lab_id}" if lab_id else ""
    dest = cache_root() / f"student-edition{lab}-{digest[:16]}"
    if (dest / MARKER).is_file():  # the fast path: built before (renamed into place whole)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if not (dest / MARKER).is_file():  # another process may have built it meanwhile
            tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
            try:
                _write_tree(tmp, files, digest, lab_id)
                _publish(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


__all__ = ["build", "edition_for_grading", "is_student_edition", "verify"]
