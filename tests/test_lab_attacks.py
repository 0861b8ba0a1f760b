"""Issue 31's attack table: each row is a malicious submission, graded for real (grader.grade, or
the ``grade`` command), that must score 0 -- or the honest score of what it implements.

A row that imports, execs or inherits the reference must score 0 twice: with copy detection
(copies.py names it) and with copy detection switched off (the sandbox alone: the worker's
edition of pagedlearn has the lab's graded functions as stubs). Rows that attack the grader
itself (fake answers on its pipe, a stolen ``say``, patched checks, a grandchild that outlives
the grader, a memory hog, a flood of text) must get nothing: a verdict is computed only in the
grading process, from what the student's code returned. Every report is also checked for the
invariants no submission may break (:func:`_sane`): the score is the sum of the outcomes', each
outcome is a known check scoring at most its points.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HONEST_ALLOCATOR, filled

import pagedlearn
from pagedlearn.labs import get
from pagedlearn.labs.grader import MAX_MESSAGE, Report, grade
from pagedlearn.labs.handout import EXERCISE_TAG
from pagedlearn.labs.runner import PASSED

ALLOCATOR, COW, KERNEL = get("allocator"), get("cow"), get("kernel")
ROOT = Path(pagedlearn.__file__).resolve().parents[1]  # the repository (the reference is here)
FAST = 5.0  # time_limit: no check here needs more (a stub answers at once)
NOT_WRITTEN, NOT_YET = "not written in the submission", "not implemented yet"
RUNTIME = "loads code at run time"


# --- invariants every report keeps ----------------------------------------------------------------
def _sane(report: Report) -> None:
    """Row 13: an unknown check name or a score above a check's points cannot appear."""
    points = {c.name: c.points for c in report.lab.checks}
    names = [o.check for o in report.outcomes]
    assert len(names) == len(set(names)) and set(names) <= set(points), names
    for o in report.outcomes:
        assert 0 <= o.score <= points[o.check] and o.max_score == points[o.check], o
        assert (o.score == points[o.check]) == (o.status == PASSED), o
    assert report.score == sum(o.score for o in report.outcomes) <= report.max_score
    _sane_json(report.gradescope(), report.lab)


def _sane_json(data: dict, lab) -> None:
    """The same, on Gradescope's results.json."""
    points = {f"{c.exercise}: {c.name.replace('_', ' ')}": c.points for c in lab.checks}
    names = [t["name"] for t in data["tests"]]
    assert len(names) == len(set(names)) and set(names) <= set(points), names
    for t in data["tests"]:
        assert 0 <= t["score"] <= t["max_score"] == points[t["name"]], t
    assert data["score"] == sum(t["score"] for t in data["tests"]) <= lab.max_score


def _zero(report: Report, *phrases: str) -> None:
    """Scored 0, every check run, each message saying one of ``phrases`` (why)."""
    _sane(report)
    assert report.load_error is None, report.load_error
    assert report.score == 0, report.text()
    assert len(report.outcomes) == len(report.lab.checks), report.text()
    for o in report.outcomes:
        assert any(p in o.message for p in phrases), (phrases, o.message)


@pytest.fixture(params=["copies_on", "copies_off"])
def copies(request, monkeypatch) -> str:
    """Both ways: with copy detection, and with it switched off (the sandbox alone)."""
    if request.param == "copies_off":
        monkeypatch.setattr("pagedlearn.labs.copies.find_copies", lambda lab, paths: {})
    return request.param


def _write(tmp_path: Path, name: str, text: str) -> list[str]:
    (tmp_path / name).write_text(text)
    return [str(tmp_path / name)]


def _handout(lab, tmp_path: Path, bodies: dict[str, str] | None = None, tail: str = "") -> list:
    """``lab``'s handout files in ``tmp_path``: each ``{qualname: body}`` replaces that stub
    (``body`` indented for a method), and ``tail`` ends the first file (runs at import)."""
    files = filled(lab, bodies or {})
    first = next(iter(files))
    files[first] += "\n" + tail
    return [p for name, text in files.items() for p in _write(tmp_path, name, text)]


def _notebook(lab, tmp_path: Path, cell_code: str) -> list[str]:
    """``lab``'s handout notebook, made as ``labs export`` makes it, with every exercise cell's
    code replaced by ``cell_code``."""
    import jupytext

    from pagedlearn.cli.chapters import clean
    from pagedlearn.labs.notebooks import fill_exercises, lab_notebook

    nb = jupytext.read(lab_notebook(lab.id))
    fill_exercises(nb, lab.id, blank=True)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    path = tmp_path / f"{lab.number:02d}_{lab.id}.ipynb"
    jupytext.write(clean(nb), path, fmt="ipynb")
    data = json.loads(path.read_text())
    replaced = 0
    for cell in data["cells"]:
        if EXERCISE_TAG in cell.get("metadata", {}).get("tags", []):
            cell["source"], replaced = cell_code, replaced + 1
    assert replaced == len(lab.exercises), replaced
    path.write_text(json.dumps(data))
    return [str(path)]


def _cli(lab_id: str, paths: list[str], json_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedlearn", "grade", lab_id, *paths, "--json", str(json_path)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# --- rows 1-5: the reference, imported, exec-ed, inherited ----------------------------------------
def test_1_a_star_import_of_the_reference_scores_zero(tmp_path, copies):
    code = "from pagedlearn.core.kv_cache_manager import *\n"
    paths = _write(tmp_path, "kv_cache_manager.py", code)
    report = grade("cow", paths, time_limit=FAST)
    _zero(report, NOT_WRITTEN if copies == "copies_on" else NOT_YET)


def test_2_an_exec_of_the_installed_reference_scores_zero(tmp_path, copies):
    code = (
        "import importlib.util\n"
        "spec = importlib.util.find_spec('pagedlearn.core.kv_cache_manager')\n"
        "exec(open(spec.origin).read())\n"
    )
    report = grade("cow", _write(tmp_path, "kv_cache_manager.py", code), time_limit=FAST)
    _zero(report, RUNTIME if copies == "copies_on" else NOT_YET)


def test_3_kernel_helpers_imported_from_the_reference_score_zero(tmp_path, copies):
    code = "from kernels.decode_attention import _attend_tile, _split_result\n"
    report = grade("kernel", _write(tmp_path, "decode_attention.py", code), time_limit=30)
    _zero(report, NOT_WRITTEN if copies == "copies_on" else NOT_YET)


def test_4_a_cow_notebook_inheriting_what_start_put_there_scores_zero(tmp_path, copies):
    paths = _notebook(COW, tmp_path, "class KVCacheManager(KVCacheManager): pass\n")
    report = grade("cow", paths, time_limit=FAST)
    _zero(report, NOT_WRITTEN if copies == "copies_on" else NOT_YET)


def test_5_a_kernel_notebook_with_its_exercise_cells_emptied_scores_zero(tmp_path, copies):
    report = grade("kernel", _notebook(KERNEL, tmp_path, ""), time_limit=30)
    _zero(report, NOT_WRITTEN if copies == "copies_on" else NOT_YET)


# --- row 6: fake results and protocol answers written into every pipe -----------------------------
FLOODS = {
    "results_first": "fake + ok_null + ok_true",
    "answers_first": "ok_null + [{'loaded': True}] + ok_true + fake",
    "loaded_then_true": "[{'loaded': True}] + ok_true * 5",
}


@pytest.mark.parametrize("order", list(FLOODS))
def test_6_fake_lines_in_every_pipe_score_nothing(tmp_path, order):
    names = [c.name for c in ALLOCATOR.checks] + ["no_such_check"]
    tail = f"""
import json as _json, os as _os, stat as _stat
fake = [{{"check": n, "status": "passed", "score": 1000}} for n in {names!r}]
ok_null, ok_true = [{{"ok": None}}] * 20, [{{"ok": True}}] * 20
_data = b"".join(_json.dumps(x).encode() + b"\\n" for x in {FLOODS[order]})
_pipes = []
for _fd in [1, *range(3, 256)]:
    try:
        if _stat.S_ISFIFO(_os.fstat(_fd).st_mode):
            _pipes.append(_fd)
    except OSError:
        pass
open({str(tmp_path / "pipes")!r}, "w").write(repr(_pipes))
for _fd in _pipes:
    try:
        _os.write(_fd, _data)
    except OSError:
        pass
"""
    report = grade("allocator", _handout(ALLOCATOR, tmp_path, tail=tail), time_limit=FAST)
    assert (tmp_path / "pipes").read_text() != "[]"  # it found pipes to write into
    _sane(report)
    assert report.score == 0, report.text()
    assert all(o.status != PASSED for o in report.outcomes)


# --- row 7: the worker's own functions, found on the stack ----------------------------------------
STEAL = """
import json as _json, os as _os, sys as _sys
_fake = [{{"check": c, "status": "passed", "score": 1000}} for c in {names!r}]
_fake += [{{"loaded": True}}] + [{{"ok": True}}] * 20
_found = []
_f = _sys._getframe()
while _f is not None:  # first find what could report for the worker...
    for _k, _v in list(_f.f_locals.items()):
        try:
            if _k == "say" and callable(_v):
                _found.append(("say", _v))
            elif type(_v).__name__ == "Host":
                _found.append(("Host", _v))
            elif hasattr(_v, "write") and hasattr(_v, "fileno") and _v is not _sys.stderr:
                _found.append((_k, _v))
        except Exception:
            pass
    _f = _f.f_back
with open({hit!r}, "w") as _h:  # (written first: the grader may kill this process any moment)
    _h.write(" ".join(_k for _k, _ in _found))
for _k, _v in _found:  # ... then use it
    try:
        if _k == "say":
            for _x in _fake:
                _v(_x)
        elif _k == "Host":
            _v.answer = lambda request: {{"ok": True}}
        else:
            _v.write(b"".join(_json.dumps(x).encode() + b"\\n" for x in _fake))
            _v.flush()
    except Exception:
        pass
_os._exit(0)
"""


@pytest.mark.parametrize("when", ["at_import", "in_a_method"])
def test_7_a_stub_that_steals_say_from_the_stack_scores_nothing(tmp_path, when):
    names = [c.name for c in ALLOCATOR.checks]
    steal = STEAL.format(names=names, hit=str(tmp_path / "hit"))
    if when == "at_import":
        paths = _handout(ALLOCATOR, tmp_path, tail=steal)
    else:
        body = "\n".join("        " + line for line in steal.strip("\n").splitlines())
        paths = _handout(ALLOCATOR, tmp_path, {"BlockAllocator.allocate": body})
    report = grade("allocator", paths, time_limit=FAST)
    assert "say" in (tmp_path / "hit").read_text()  # the attack did find the worker's say
    _sane(report)
    assert report.score == 0, report.text()
    assert report.exit_code != 0


# --- row 8: the checks, patched where the student's code runs -------------------------------------
PATCHES = {
    "outcome": """
import pagedlearn.labs.runner as _runner
_Real = _runner.Outcome
_runner.Outcome = lambda c, e, s, sc, m, *a, **k: _Real(c, e, "passed", m, m)
""",
    "check_funcs": """
from pagedlearn.labs import get as _get
for _c in _get("allocator").checks:
    object.__setattr__(_c, "func", lambda sub: None)
""",
    "run_check": """
import pagedlearn.labs.runner as _runner
import pagedlearn.labs.grader as _grader
_ok = lambda c, sub, t=None: _runner.Outcome(c.name, c.exercise, "passed", c.points, c.points)
_runner.run_check = _ok
_grader.grade = lambda *a, **k: None
""",
}


@pytest.mark.parametrize("patch", list(PATCHES))
def test_8_patching_the_checks_in_the_worker_changes_nothing(tmp_path, patch):
    report = grade("allocator", _handout(ALLOCATOR, tmp_path, tail=PATCHES[patch]), time_limit=FAST)
    _zero(report, NOT_YET)


# --- row 9: a grandchild that outlives the grader and rewrites --json -----------------------------
GRANDCHILD = """
import os as _os, sys as _sys, time as _time
def _rewrite(path):
    for _ in range(60):  # for 6 s: any --json written before it is killed is rewritten
        _time.sleep(0.1)
        try:
            if _os.path.exists(path) and '"score": 20,' not in open(path).read():
                open(path, "w").write('{"score": 20, "tests": []}')
        except OSError:
            pass
"""
SPAWN = {
    "double_fork_setsid": """
_child = _os.fork()
if _child == 0:
    _os.setsid()
    _grandchild = _os.fork()
    if _grandchild:
        open({pid!r}, "w").write(str(_grandchild))
        _os._exit(0)
    _rewrite({out!r})
    _os._exit(0)
_os.waitpid(_child, 0)
""",
    "popen_new_session": """
import subprocess as _sp
_code = {code!r}
_p = _sp.Popen([_sys.executable, "-c", _code], start_new_session=True)
open({pid!r}, "w").write(str(_p.pid))
""",
}


@pytest.mark.parametrize("how", list(SPAWN))
def test_9_a_setsid_grandchild_cannot_rewrite_the_results(tmp_path, how):
    tmp_path.chmod(0o777)  # the worker may run as another user: it must write the pid file
    out, pid_file = tmp_path / "results.json", tmp_path / "grandchild.pid"
    code = GRANDCHILD + f"_rewrite({str(out)!r})\n"
    tail = GRANDCHILD + SPAWN[how].format(pid=str(pid_file), out=str(out), code=code)
    done = _cli("allocator", _handout(ALLOCATOR, tmp_path, tail=tail), out)
    assert done.returncode == 1, done.stderr
    pid = int(pid_file.read_text())  # the grandchild was started
    time.sleep(3)
    data = json.loads(out.read_text())
    _sane_json(data, ALLOCATOR)
    assert data["score"] == 0 and len(data["tests"]) == len(ALLOCATOR.checks), data
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# --- rows 10, 11: a memory hog, a flood of text ---------------------------------------------------
def test_10_a_20_gb_allocation_fails_its_check_and_grading_goes_on(tmp_path):
    body = "        hog = bytearray(20 << 30)\n        return [len(hog)]\n"
    paths = _handout(ALLOCATOR, tmp_path, {"BlockAllocator.allocate": body})
    report = grade("allocator", paths, time_limit=FAST)
    _sane(report)
    assert report.score == 0 and report.exit_code == 1, report.text()
    assert len(report.outcomes) == len(ALLOCATOR.checks)
    first = report.outcomes[0]  # allocate_takes_free_blocks_in_order
    assert first.status != PASSED and any(w in first.message for w in ("MemoryError", "killed")), (
        first.message
    )
    table = [o for o in report.outcomes if o.exercise == "table"]
    assert table and all(NOT_YET in o.message for o in table)  # the grader went on


FLOOD = {
    "raised_in_a_method": ("body", '        raise ValueError("x" * 10**6)\n'),
    "a_huge_exception_class": (
        "body",
        '        raise type("E" * 10**5, (Exception,), {})("y" * 10**6)\n',
    ),
    "a_huge_return_value": ("body", "        return list(range(10**6))\n"),
    "raised_at_import": ("tail", 'raise ValueError("x" * 10**6)\n'),
}


@pytest.mark.parametrize("what", list(FLOOD))
def test_11_a_huge_message_is_cut(tmp_path, what):
    where, code = FLOOD[what]
    if where == "body":
        paths = _handout(ALLOCATOR, tmp_path, {"BlockAllocator.allocate": code})
    else:
        paths = _handout(ALLOCATOR, tmp_path, tail=code)
    report = grade("allocator", paths, time_limit=FAST)
    _sane(report)
    assert report.score == 0
    assert all(len(o.message) <= MAX_MESSAGE for o in report.outcomes)
    assert len(json.dumps(report.gradescope())) < len(ALLOCATOR.checks) * (MAX_MESSAGE + 500)
    assert len(report.text()) < len(ALLOCATOR.checks) * (MAX_MESSAGE + 500)
    if where == "tail":
        assert report.load_error is not None and len(report.load_error) <= 1100


# --- row 12: an honest solution still gets full marks ---------------------------------------------
def test_12_an_honest_solution_gets_full_marks_through_the_cli(tmp_path):
    out = tmp_path / "results.json"
    done = _cli("allocator", _handout(ALLOCATOR, tmp_path, HONEST_ALLOCATOR), out)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    _sane_json(data, ALLOCATOR)
    assert data["score"] == ALLOCATOR.max_score == 20, data
    assert "score 20/20" in done.stdout


# --- beyond the table -----------------------------------------------------------------------------
def _worker_runs_as_the_grader() -> bool:
    from pagedlearn.labs.sandbox import _sandbox_user

    return _sandbox_user([]) is None


@pytest.mark.xfail(
    _worker_runs_as_the_grader(),
    strict=True,
    reason="HOLE: the worker runs as the grader's own user (not root, or root without a usable "
    "unprivileged user), so it can read the reference's source where the grading environment "
    "has it; copies.py does not see it (the path is not spelled out, `code.InteractiveInterpreter"
    ".runsource` is not on its list of exec-likes, and the file imports nothing of pagedlearn)",
)
def test_reading_the_reference_off_the_grader_s_disk_scores_zero(tmp_path):
    hidden = str(ROOT / "pagedlearn" / "core" / "kv_cache_manager.py")[::-1]  # found via /proc
    code = (
        "import code as _code\n"
        "_ns = {'__name__': 'kv_copy'}\n"
        f"with open({hidden!r}[::-1]) as _fh:\n"
        "    _text = _fh.read()\n"
        "_code.InteractiveInterpreter(_ns).runsource(_text, 'kv', 'exec')\n"
        "KVCacheManager = _ns['KVCacheManager']\n"
    )
    report = grade("cow", _write(tmp_path, "kv_cache_manager.py", code), time_limit=FAST)
    _sane(report)
    assert report.score == 0, report.text()
