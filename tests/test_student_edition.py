"""The student edition (pagedlearn/labs/student_edition.py): every graded function a stub that names
its lab, nothing of the reference anywhere in the tree, importable in place of the package."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedlearn.labs import all_labs, get
from pagedlearn.labs.handout import ROOT, _body_lines, _defined_in, _find
from pagedlearn.labs.student_edition import (
    MARKER,
    build,
    edition_for_grading,
    is_student_edition,
    verify,
)


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("export") / "pagedlearn-student")


def _graded_functions():
    """``(lab, file, qualname, def node, source lines)`` of every function any lab grades."""
    for lab in all_labs():
        for path in lab.files:
            source = (ROOT / path).read_text()
            for q in (q for ex in lab.exercises for q in ex.targets):
                if _defined_in(source, q):
                    yield lab, path, q, _find(ast.parse(source), q), source.splitlines()


def _norm(text: str) -> str:
    """Each line stripped: a copy found at any indentation."""
    return "\n".join(line.strip() for line in text.splitlines())


def test_no_file_of_the_edition_holds_a_graded_body(edition):
    files = {
        p: p.read_bytes().decode("utf-8", "replace") for p in edition.rglob("*") if p.is_file()
    }
    assert len(files) > 100 and (edition / "pyproject.toml").is_file()
    normed = {p: _norm(t) for p, t in files.items()}
    line_sets = {p: set(t.splitlines()) for p, t in normed.items()}
    checked = 0
    for lab, path, q, fn, lines in _graded_functions():
        first, last, _ = _body_lines(fn)
        body = _norm("\n".join(lines[first - 1 : last]))
        unparsed = "\n".join(ast.unparse(s) for s in fn.body if s.lineno >= first)
        # Distinctive lines of code (long, not a comment): a file holding more than half of them
        # holds the body, however reshuffled (a stub holds none: it is one `raise`).
        distinct = [ln for ln in body.splitlines() if len(ln) >= 30 and not ln.startswith("#")]
        for p, text in files.items():
            where = f"{p.relative_to(edition)} holds lab {lab.id}'s {q} ({path})"
            assert body not in normed[p] and unparsed not in text, where
            hits = sum(ln in line_sets[p] for ln in distinct)
            assert hits <= len(distinct) / 2, f"{where}: {hits} of its {len(distinct)} lines"
        checked += 1
    assert checked == sum(len(ex.targets) for lab in all_labs() for ex in lab.exercises)


def test_the_edition_holds_sources_only_and_every_graded_function_is_a_stub(edition):
    assert not [p for p in edition.rglob("*") if p.name == "__pycache__" or p.suffix == ".pyc"]
    assert not (edition / "notebooks").exists() and not list(edition.rglob("*.ipynb"))
    assert {p.name for p in edition.iterdir()} == {
        "pagedlearn",
        "kernels",
        "pyproject.toml",
        "README.md",
    }
    verify(edition)  # raises if any target is not a stub
    text = (edition / "pagedlearn/core/kv_cache_manager.py").read_text()
    assert "KVCacheManager.fork is lab 2, cow: not written yet -- " in text
    assert "pip install -e pagedlearn-student" in (edition / "README.md").read_text()
    assert '"hypothesis' in (edition / "pyproject.toml").read_text()  # check() needs it


def test_verify_names_the_function_that_is_not_a_stub(edition, tmp_path):
    copy = tmp_path / "copy"
    for p in edition.rglob("*.py"):
        (copy / p.relative_to(edition)).parent.mkdir(parents=True, exist_ok=True)
        (copy / p.relative_to(edition)).write_bytes(p.read_bytes())
    (copy / "pagedlearn/core/block_table.py").write_text(
        (ROOT / "pagedlearn/core/block_table.py").read_text()
    )
    with pytest.raises(AssertionError, match=r"block_table.py: BlockTable\.\w+ is not a stub"):
        verify(copy)


SCRIPT = """
import json, sys
from pathlib import Path
import pagedlearn, kernels
from pagedlearn import BlockAllocator
from pagedlearn.labs.student_edition import is_student_edition
out = {"files": [pagedlearn.__file__, kernels.__file__], "edition": is_student_edition()}
try:
    BlockAllocator(4).allocate(1)
except NotImplementedError as e:
    out["raised"] = str(e)
import kernels.decode_attention as da
out["kernel"] = da.__file__
from kernels import paged_attention_prefill  # withheld: its loop is lab 5's answer
try:
    paged_attention_prefill(*[None] * 6)
except NotImplementedError as e:
    out["withheld"] = str(e)
print(json.dumps(out))
"""


def test_the_edition_imports_in_place_of_the_package_and_stubs_say_their_lab(edition, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(edition), "PYTHONDONTWRITEBYTECODE": "1"}
    env.setdefault("TRITON_INTERPRET", "1")  # import the kernel file as a CPU machine would
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    for f in (*out["files"], out["kernel"]):  # the editable repository install is not used
        assert Path(f).resolve().is_relative_to(edition.resolve()), f
    assert out["raised"].startswith("BlockAllocator.allocate is lab 1, allocator: not written yet")
    assert out["withheld"].startswith(
        "paged_attention_prefill is withheld from the student edition"
    )
    assert out["edition"] is True and is_student_edition() is False  # here: the repository
    assert not list(edition.rglob("__pycache__"))


def test_build_replaces_an_old_edition_and_refuses_any_other_folder(edition, tmp_path):
    old = build(tmp_path / "pagedlearn-student", record=False)
    (old / "pagedlearn" / "stale.py").write_text("x = 1\n")
    assert build(old, record=False) == old and not (old / "pagedlearn" / "stale.py").exists()
    other = tmp_path / "work"
    (other / "notes.txt").parent.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a student edition"):
        build(other)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pagedlearn-student", "work"]


def test_the_graders_edition_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLEARN_CACHE", str(tmp_path))
    first = edition_for_grading()
    start = time.perf_counter()
    again = edition_for_grading()
    assert again == first and time.perf_counter() - start < 1.0
    assert first.parent == tmp_path and first.name.startswith("student-edition-")
    assert (first / MARKER).is_file() and not (first / "pyproject.toml").exists()
    assert oct(first.stat().st_mode & 0o777) == oct(0o755)  # readable by a sandboxed worker
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no half-built tree
    verify(first)


# --- feedback and grading in the student edition: the reference's recorded answers, replayed ------
def _in_edition(edition: Path, tmp_path: Path, *args: str):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(edition), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "pagedlearn", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_grade_in_the_edition_replays_the_references_answers(edition, tmp_path):
    """No reference there, and still the verdicts: a correct solution gets full marks, the
    untouched files 0, a mistake its message -- from answers recorded at export."""
    assert sorted(p.name for p in (edition / "pagedlearn/labs/expected").iterdir()) == sorted(
        f"{lab}.json.gz"
        for lab in ("allocator", "attention", "cow", "kernel", "prefix", "scheduler")
    )
    lab = get("allocator")
    right = [str(ROOT / f) for f in lab.files]  # correct answers (written by the package's authors)
    r = _in_edition(edition, tmp_path, "grade", "allocator", *right)
    assert r.returncode == 0 and "score 20/20" in r.stdout, r.stdout + r.stderr

    stubs = [str(edition / f) for f in lab.files]
    r = _in_edition(edition, tmp_path, "grade", "allocator", *stubs)
    assert r.returncode == 1 and "score 0/20" in r.stdout, r.stdout + r.stderr
    assert "BlockAllocator.allocate is lab 1, allocator: not written yet" in r.stdout

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for f in lab.files:
        text = (ROOT / f).read_text()
        (wrong / Path(f).name).write_text(
            text.replace(
                "self._free_cached.popitem(last=False)", "self._free_cached.popitem(last=True)"
            )
        )
    r = _in_edition(edition, tmp_path, "grade", "allocator", *map(str, wrong.iterdir()))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[FAIL] 0/2  pool: cached blocks are evicted least recently freed first" in r.stdout
    # The recorded request in the check's words, the reference's answer and theirs:
    assert "in a pool of 5 blocks, after allocate(5); mark_cached(1);" in r.stdout
    assert "should return [3]; yours returned [4]" in r.stdout

    r = _in_edition(edition, tmp_path, "grade", "allocator", "--reference")
    assert r.returncode == 2 and "no reference" in r.stderr


def test_a_later_lab_runs_on_the_students_earlier_ones_in_the_edition(edition, tmp_path):
    """The cow lab's manager takes blocks from the allocator: in the edition that is the
    student's lab 1, given with the submission."""
    files = [str(ROOT / f) for lab_id in ("allocator", "cow", "prefix") for f in get(lab_id).files]
    r = _in_edition(edition, tmp_path, "grade", "cow", *files)
    assert r.returncode == 0 and "score 32/32" in r.stdout, r.stdout + r.stderr
