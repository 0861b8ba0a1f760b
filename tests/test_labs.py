"""The lab machinery: the handout, loading a submission, the runner, the grader and its CLI, the
export, and the lab notebooks. (Each lab's own checks are tested in tests/test_lab_<lab>.py.)

The grader is exercised end to end, as an instructor runs it: ``python -m pagedlearn grade`` on the
reference (full marks for every lab), on the untouched handout (0 points, no crash), and on
submissions that do not load, loop forever, or kill the process.
"""

from __future__ import annotations

import ast
import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import grade_lab, submit

from pagedlearn.labs import LAB_IDS, get
from pagedlearn.labs.handout import _find, blank_source, exercise_code, is_stub, lab_files
from pagedlearn.labs.lab import Check, CheckFailed, Exercise, Lab
from pagedlearn.labs.runner import ERROR, FAILED, NOT_DONE, PASSED, run_check
from pagedlearn.labs.submission import SubmissionError, load, reference

ROOT = Path(__file__).resolve().parents[1]
SOURCE = '''\
"""A module."""

import math


def area(r):
    """The area of a circle."""
    # a comment that would give it away
    return math.pi * r * r


class Shape:
    sides = 0

    def describe(self):
        return f"{self.sides} sides"

    def double(self, x):
        """Twice x."""
        return 2 * x
'''


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedlearn", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


# --- the handout ---------------------------------------------------------------------------------
def test_blank_source_keeps_everything_but_the_bodies():
    out = blank_source(SOURCE, {"area": "compute it", "Shape.double": "double it"}, "demo")
    assert "# a comment that would give it away" not in out and "2 * x" not in out
    assert "raise NotImplementedError('demo: compute it')" in out
    assert '"""The area of a circle."""' in out and "def double(self, x):" in out
    assert 'return f"{self.sides} sides"' in out  # not a target: untouched
    tree = ast.parse(out)
    assert is_stub(_find(tree, "area")) and is_stub(_find(tree, "Shape.double"))
    assert not is_stub(_find(tree, "Shape.describe"))
    ns: dict = {}
    exec(compile(out, "handout", "exec"), ns)
    with pytest.raises(NotImplementedError, match="demo: double it"):
        ns["Shape"]().double(1)


def test_blank_source_names_a_missing_target():
    with pytest.raises(LookupError, match=r"Shape\.triple"):
        blank_source(SOURCE, {"Shape.triple": "x"}, "demo")


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_every_target_is_blanked_in_the_handout_and_nothing_else_changes(lab_id):
    lab = get(lab_id)
    blank, full = lab_files(lab, blank=True), lab_files(lab, blank=False)
    targets = [q for ex in lab.exercises for q in ex.targets]
    found = set()
    for name, source in blank.items():
        tree, ref = ast.parse(source), ast.parse(full[name])
        for q in targets:
            try:
                fn = _find(tree, q)
            except LookupError:
                continue
            found.add(q)
            assert is_stub(fn), f"{name}: {q} is not a stub"
            assert ast.get_docstring(fn) == ast.get_docstring(_find(ref, q))
        stubbed = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Raise)]
        assert stubbed, name
    assert found == set(targets), f"targets in no reference file: {set(targets) - found}"
    for ex in lab.exercises:  # the notebook cells, both ways, are valid Python
        ast.parse(exercise_code(lab, ex, blank=True))
        ast.parse(exercise_code(lab, ex, blank=False))


# --- loading and running -------------------------------------------------------------------------
TOY = Lab(
    "toy",
    0,
    "toy",
    "none",
    ("pagedlearn/core/block_table.py",),
    (Exercise("slots", "slots", {"BlockTable.slot": "find the slot"}),),
)


def test_load_names_what_is_wrong_in_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class BlockTable:\n    def slot(self, i)\n        return 0\n")
    with pytest.raises(SubmissionError, match=r"bad.py, line 2: SyntaxError"):
        load(TOY, [bad])
    with pytest.raises(SubmissionError, match="no such file"):
        load(TOY, [tmp_path / "missing.py"])
    boom = tmp_path / "boom.py"
    boom.write_text("x = 1\nclass BlockTable:\n    pass\nundefined_name\n")
    with pytest.raises(SubmissionError, match=r"NameError.*boom.py, line 4"):
        load(TOY, [boom])
    other = tmp_path / "other.py"
    other.write_text("def something_else():\n    pass\n")
    with pytest.raises(SubmissionError, match="defines none of the lab's names"):
        load(TOY, [other])
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(SubmissionError, match="SystemExit"):
        load(TOY, [exits])


def test_runner_turns_every_ending_into_a_verdict(tmp_path):
    sub_file = tmp_path / "s.py"
    sub_file.write_text(
        textwrap.dedent(
            """
            class BlockTable:
                def slot(self, i):
                    if i == 0:
                        raise NotImplementedError("toy: find the slot")
                    if i == 1:
                        return {}["missing"]
                    while i == 2:
                        pass
                    return i
            """
        )
    )
    sub = load(TOY, [sub_file])

    def check_with(i, expected):
        def func(s):
            got = s.BlockTable().slot(i)
            if got != expected:
                raise CheckFailed(f"slot({i}) should be {expected}; yours is {got}")

        return Check(f"slot_{i}", "slots", 2, func, 0.5)

    assert run_check(check_with(0, 0), sub).status == NOT_DONE
    crash = run_check(check_with(1, 1), sub)
    assert crash.status == ERROR and "KeyError" in crash.message and "s.py, line 7" in crash.message
    loop = run_check(check_with(2, 2), sub)
    assert loop.status == ERROR and "took longer than 0.5 s" in loop.message
    wrong = run_check(check_with(3, 4), sub)
    assert (wrong.status, wrong.score, wrong.message) == (
        FAILED,
        0,
        "slot(3) should be 4; yours is 3",
    )
    assert run_check(check_with(5, 5), sub).status == PASSED
    missing = run_check(Check("m", "slots", 1, lambda s: s.Nope, 1), sub)
    assert missing.status == FAILED and "does not define 'Nope'" in missing.message


# --- each lab, in-process ------------------------------------------------------------------------
@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_each_lab_is_well_formed_and_grades_reference_and_handout(lab_id, tmp_path):
    """A lab's shape (its number, 8-15 checks of 1-3 points, every exercise checked), then its
    checks in-process: the reference gets full marks, the untouched handout 0 points, and every
    stub says which lab's task is not done yet."""
    if lab_id == "kernel":
        pytest.importorskip("triton")  # its checks launch the Triton kernel
    lab = get(lab_id)
    assert lab.number == LAB_IDS.index(lab_id) + 1
    assert 8 <= len(lab.checks) <= 15
    assert [c.name for c in lab.checks if not 1 <= c.points <= 3] == []
    exercises = [ex.id for ex in lab.exercises]
    assert [ex for ex in exercises if not lab.checks_of(ex)] == [], "exercises without checks"
    assert [c.name for c in lab.checks if c.exercise not in exercises] == [], "unknown exercise"

    outcomes = grade_lab(lab, reference(lab))
    assert [o.message for o in outcomes if not o.passed] == []
    assert sum(o.score for o in outcomes) == lab.max_score

    outcomes = grade_lab(lab, submit(lab, tmp_path, lab_files(lab, blank=True)))
    assert sum(o.score for o in outcomes) == 0
    # A stub is reported as work to do, never as a wrong answer.
    assert {o.status for o in outcomes} == {NOT_DONE}
    not_done = [o.message for o in outcomes if o.status == NOT_DONE]
    assert [m for m in not_done if not m.startswith(f"not implemented yet -- {lab_id}: ")] == []


# --- the grader, end to end -----------------------------------------------------------------------
@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_the_reference_gets_full_marks(lab_id, tmp_path):
    out = tmp_path / "results.json"
    r = cli("grade", lab_id, "--reference", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads(out.read_text())
    lab = get(lab_id)
    assert results["score"] == lab.max_score > 0
    assert len(results["tests"]) == len(lab.checks) >= 8
    for t in results["tests"]:
        assert set(t) >= {"name", "score", "max_score", "output"} and t["score"] == t["max_score"]
    assert f"score {lab.max_score}/{lab.max_score}" in r.stdout


@pytest.fixture(scope="module")
def handout(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("handout")
    r = cli("labs", "export", str(out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_the_untouched_handout_gets_zero_without_a_crash(lab_id, handout, tmp_path):
    lab = get(lab_id)
    folder = handout / f"{lab.number:02d}_{lab_id}"
    files = [str(folder / Path(f).name) for f in lab.files]
    notebooks = sorted(folder.glob("*.ipynb"))
    assert len(notebooks) == 1, "each lab has one notebook"
    for submission in (files, [str(notebooks[0])]):
        out = tmp_path / "results.json"
        r = cli("grade", lab_id, *submission, "--json", str(out))
        assert r.returncode == 1, r.stdout + r.stderr
        assert "Traceback" not in r.stdout + r.stderr
        results = json.loads(out.read_text())
        assert results["score"] == 0 and len(results["tests"]) == len(lab.checks)
        assert "not implemented yet" in r.stdout


def _text(path: Path) -> str:
    """A file as text; the student edition's recorded answers (``.json.gz``) uncompressed."""
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode()


def test_export_writes_no_solution(handout):
    text = "\n".join(_text(p) for p in handout.rglob("*") if p.is_file())
    for lab_id in LAB_IDS:
        lab = get(lab_id)
        for path in lab.files:
            tree = ast.parse((ROOT / path).read_text())
            for q in (q for ex in lab.exercises for q in ex.targets):
                try:
                    fn = _find(tree, q)
                except LookupError:
                    continue
                body = [s for s in fn.body if not isinstance(s, ast.Expr)] or fn.body
                # The longest line of each body is distinctive enough to find a leak.
                lines = [ast.unparse(s).splitlines()[0] for s in body]
                longest = max(lines, key=len)
                if len(longest) > 25:
                    assert longest not in text, f"{lab_id}: the handout contains {q}'s {longest!r}"
    assert (handout / "README.md").exists()


def test_labs_list_names_each_lab_in_order():
    r = cli("labs", "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(LAB_IDS)
    for line, lab_id in zip(lines, LAB_IDS, strict=True):
        assert get(lab_id).files[0] in line and get(lab_id).title in line


def test_grade_exits_2_with_one_line_when_the_submission_cannot_load(tmp_path):
    bad = tmp_path / "block_allocator.py"
    bad.write_text("class BlockAllocator:\n    def allocate(self, n)\n        pass\n")
    for args in ((str(bad),), (str(tmp_path / "nope.py"),), ()):
        r = cli("grade", "allocator", *args, "--json", str(tmp_path / "r.json"))
        assert r.returncode == 2, r.stdout + r.stderr
        said = [ln for ln in r.stderr.splitlines() if not ln.startswith("grade: warning:")]
        assert "Traceback" not in r.stderr and len(said) == 1, r.stderr
    assert json.loads((tmp_path / "r.json").read_text())["score"] == 0
    assert cli("grade", "nolab", str(bad)).returncode == 2


def test_a_looping_or_exiting_submission_costs_points_not_the_grader(tmp_path, monkeypatch):
    from pagedlearn.labs import copies, grader

    monkeypatch.setattr(grader, "MARGIN_S", 1.0)
    # Made from the reference's own files, which copies.py would (rightly) zero as copies: this
    # test is about the worker's limits, so it grades them as the student's.
    monkeypatch.setattr(copies, "find_copies", lambda lab, paths: {})
    lab = get("allocator")
    files = {Path(p).name: (ROOT / p).read_text() for p in lab.files}
    # slot() ignores the SIGALRM the worker's time limit uses: only the grader's kill stops it.
    files["block_table.py"] = files["block_table.py"].replace(
        "    def slot(self, i: int) -> int:\n",
        "    def slot(self, i: int) -> int:\n"
        "        import signal\n"
        "        signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "        while True:\n"
        "            pass\n",
    )
    files["block_allocator.py"] = files["block_allocator.py"].replace(
        "    def incref(self, ids: Iterable[int]) -> None:\n",
        "    def incref(self, ids: Iterable[int]) -> None:\n"
        "        import os\n"
        "        os._exit(7)\n",
    )
    paths = []
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    report = grader.grade("allocator", paths, time_limit=1.0)
    assert report.exit_code == 1 and report.load_error is None
    messages = [o.message for o in report.outcomes]
    assert any("took longer than 1 s" in m for m in messages), messages
    assert any("ended the Python process (exit status 7)" in m for m in messages), messages
    assert any(o.status == PASSED for o in report.outcomes), "the other checks still ran"
    assert len(report.outcomes) == len(lab.checks)


# --- the lab notebooks ---------------------------------------------------------------------------
def _run_notebook(nb, cwd: Path, timeout: int = 300):
    import os

    import nbclient

    from pagedlearn.cli.chapters import OFFLINE_ENV

    old = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, resources={"metadata": {"path": cwd}})
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_lab_notebook_is_generated_from_the_source_and_paired(lab_id):
    jupytext = pytest.importorskip("jupytext")
    from pagedlearn.labs.notebooks import fill_exercises, lab_notebook

    py = lab_notebook(lab_id)
    nb = jupytext.read(py)
    committed = [c.source for c in nb.cells]
    found = fill_exercises(nb, lab_id, blank=False)
    assert committed == [c.source for c in nb.cells], f"{py.name} is stale: run `make labs`"
    assert found == [ex.id for ex in get(lab_id).exercises], "one cell per exercise, in order"
    twin = jupytext.read(py.with_suffix(".ipynb"))
    assert [c.source for c in twin.cells] == committed, f"{py.name} and its .ipynb differ"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(
        f"# Lab {get(lab_id).number}: "
    )
    assert get(lab_id).chapter in first.source, "the first cell points back to its chapter"


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_lab_notebook_runs_with_the_reference_and_stops_at_the_first_stub(lab_id):
    jupytext = pytest.importorskip("jupytext")
    pytest.importorskip("nbclient")
    from nbclient.exceptions import CellExecutionError

    from pagedlearn.labs.notebooks import LAB_NOTEBOOKS, fill_exercises, lab_notebook

    nb = _run_notebook(jupytext.read(lab_notebook(lab_id)), LAB_NOTEBOOKS)
    printed = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "[FAIL]" not in printed and "[PASS]" in printed, printed[-2000:]

    handout = jupytext.read(lab_notebook(lab_id))
    fill_exercises(handout, lab_id, blank=True)
    with pytest.raises(CellExecutionError) as info:
        _run_notebook(handout, LAB_NOTEBOOKS)
    first = get(lab_id).exercises[0]
    assert "NotImplementedError" in str(info.value)
    assert f"{lab_id}: " in str(info.value), "the message is the stub's task"
    ran = [c for c in handout.cells if c.cell_type == "code" and c.get("outputs")]
    stopped = next(c for c in handout.cells if c.source.startswith(f"# Exercise {first.id!r}"))
    assert any(o.get("ename") for o in stopped.outputs), "it stops at the first exercise"
    assert ran


def test_a_wrong_answer_in_a_notebook_prints_the_verdict_and_shows_both_pools():
    """What a student sees: the allocator notebook with "evict the most recently freed" in its
    pool cell prints a FAIL line with the operations, and shows a picture (PNG) under it."""
    jupytext = pytest.importorskip("jupytext")
    pytest.importorskip("nbclient")
    from pagedlearn.labs.notebooks import LAB_NOTEBOOKS, lab_notebook

    nb = jupytext.read(lab_notebook("allocator"))
    cell = next(c for c in nb.cells if c.source.startswith("# Exercise 'pool'"))
    lru = "block_id, _ = self._free_cached.popitem(last=False)"
    assert cell.source.count(lru) == 1
    cell.source = cell.source.replace(lru, lru.replace("False", "True"))
    _run_notebook(nb, LAB_NOTEBOOKS)
    text = "".join(o.get("text", "") for o in cell.outputs)
    assert "[FAIL] 0/2  cached blocks are evicted least recently freed first" in text
    assert "yours returned [4]" in text and "[PASS]" in text
    assert any("image/png" in o.get("data", {}) for o in cell.outputs), "no picture shown"


def test_your_kv_cache_manager_uses_a_lab_answer_only_once_it_passes(tmp_path, capsys):
    from pagedlearn.core.block_allocator import BlockAllocator
    from pagedlearn.labs.plug import nearby, your_kv_cache_manager

    lab = get("allocator")
    for blank in (True, False):
        folder = tmp_path / ("blank" if blank else "done")
        folder.mkdir()
        paths = []
        for name, text in lab_files(lab, blank=blank).items():
            (folder / name).write_text(text)
            paths.append(folder / name)
        Manager = your_kv_cache_manager(allocator=paths)
        printed = capsys.readouterr().out
        if blank:  # not done yet: the reference's, and a line that says so
            assert Manager.allocator_class is BlockAllocator
            assert f"yours scores 0/{lab.max_score} so far" in printed
        else:
            assert Manager.allocator_class is not BlockAllocator
            assert "allocator + block table: yours" in printed
            kv = Manager(num_blocks=4, block_size=2)
            assert kv.add_sequence("a", [1, 2, 3]) == 0 and kv.block_table("a") == [0, 1]
    assert your_kv_cache_manager(allocator=tmp_path / "missing.ipynb").allocator_class is (
        BlockAllocator
    )
    assert "no such file" in capsys.readouterr().out
    assert nearby("allocator", tmp_path) is None
    for folder in ("01_allocator", "03_prefix"):  # the handout's layout
        (tmp_path / folder).mkdir()
    (tmp_path / "01_allocator" / "01_allocator.ipynb").write_text("{}")
    assert nearby("allocator", tmp_path / "03_prefix") == (
        tmp_path / "03_prefix" / ".." / "01_allocator" / "01_allocator.ipynb"
    )


def test_a_submission_that_imports_the_reference_scores_zero_and_is_told_why(tmp_path):
    """The first attack an instructor worries about: the package is installed beside the
    submission, so `import *` from it passes every check -- unless the grader reads the file."""
    path = tmp_path / "kv_cache_manager.py"
    path.write_text("from pagedlearn.core.kv_cache_manager import *  # noqa\n")
    out = tmp_path / "results.json"
    r = cli("grade", "cow", str(path), "--json", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    results = json.loads(out.read_text())
    assert results["score"] == 0 and len(results["tests"]) == len(get("cow").checks)
    assert all("not written in the submission" in t["output"] for t in results["tests"])
    assert "write your own" in r.stdout


@pytest.mark.parametrize("load, usable, cpus, factor", [
    (0.3, 2, 2, 1.0), (3.0, 2, 2, 1.5), (9.0, 2, 2, 4.5), (100.0, 2, 2, 8.0), (9.0, 16, 16, 1.0),
    (40.0, 2, 64, 1.0),  # a 2-CPU container on a 64-CPU host: the host's load, its 64 CPUs
])  # fmt: skip
def test_a_check_gets_more_time_on_a_busy_machine(monkeypatch, load, usable, cpus, factor):
    """A check's limit grows with the load per CPU (issue 33: at load 9 on two cores, the
    scheduler lab's reference was stopped as an endless loop after 30 s), within bounds, read
    as the thread count reads it (a container sees its host's load average)."""
    from pagedlearn.cli import threads
    from pagedlearn.labs import runner

    monkeypatch.setattr(runner.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(runner.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(threads, "usable_cpus", lambda: usable)
    assert runner.busy_factor() == factor
