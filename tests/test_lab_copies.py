"""Copy detection (labs/copies.py): a submission that imports, inherits, calls or copies the
reference's graded code is named, exercise by exercise; the handout and an honest solution are
not. Static analysis only: nothing here runs a submission."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from helpers import HONEST_ALLOCATOR, filled, grade_lab, submit

from pagedlearn.labs import LAB_IDS, get
from pagedlearn.labs.copies import MIN_COPY_NODES, find_copies, reference_bodies
from pagedlearn.labs.export import export
from pagedlearn.labs.handout import EXERCISE_TAG, lab_files
from pagedlearn.labs.runner import PASSED

COW, KERNEL, ALLOCATOR = get("cow"), get("kernel"), get("allocator")
NOT_WRITTEN = "not written in the submission"


@pytest.fixture(scope="module")
def handout(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("handout")
    export(out)
    return out


def _write(tmp_path: Path, name: str, text: str) -> list[Path]:
    (tmp_path / name).write_text(text)
    return [tmp_path / name]


def _notebook(handout: Path, lab_id: str, tmp_path: Path, cell_code) -> list[Path]:
    """The handout's notebook of ``lab_id`` with each exercise cell's code replaced by
    ``cell_code(old_code)``."""
    lab = get(lab_id)
    path = handout / f"{lab.number:02d}_{lab_id}" / f"{lab.number:02d}_{lab_id}.ipynb"
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if EXERCISE_TAG in cell.get("metadata", {}).get("tags", []):
            cell["source"] = cell_code("".join(cell["source"]))
    return _write(tmp_path, path.name, json.dumps(nb))


def _flagged(found: dict[str, str], lab, phrase: str) -> None:
    assert set(found) == {ex.id for ex in lab.exercises}, found
    for ex_id, reason in found.items():
        assert reason.startswith(f"exercise {ex_id!r}: ") and phrase in reason, reason
        assert reason.endswith("0 points for this exercise's checks") and "\n" not in reason


# --- the attacks of issue 31 ----------------------------------------------------------------------
def test_a_star_import_of_the_reference_is_not_written(tmp_path):
    paths = _write(tmp_path, "kv.py", "from pagedlearn.core.kv_cache_manager import *\n")
    found = find_copies(COW, paths)
    _flagged(found, COW, NOT_WRITTEN)
    assert "pagedlearn.core.kv_cache_manager" in found["fork"]
    assert "KVCacheManager.fork" in found["fork"] and "write your own" in found["fork"]


def test_exec_of_the_reference_found_with_find_spec_is_named(tmp_path):
    code = (
        "import importlib.util\n"
        "spec = importlib.util.find_spec('pagedlearn.core.kv_cache_manager')\n"
        "exec(open(spec.origin).read())\n"
    )
    found = find_copies(COW, _write(tmp_path, "kv.py", code))
    _flagged(found, COW, "loads code at run time")
    # The same with the loader's own words, and by path: each way is named.
    for code in (
        "m = __import__('pagedlearn.core.kv_cache_manager', fromlist=['x'])\n"
        "KVCacheManager = m.KVCacheManager\n",
        "import sys\nsys.path.insert(0, '/somewhere/pagedlearn/core')\n",
        "from pathlib import Path\nsrc = Path('pagedlearn/core/kv_cache_manager.py').read_text()\n",
    ):
        _flagged(find_copies(COW, _write(tmp_path, "kv.py", code)), COW, "loads code at run time")


def test_a_notebook_inheriting_the_reference_is_not_written(handout, tmp_path):
    paths = _notebook(
        handout, "cow", tmp_path, lambda _: "class KVCacheManager(KVCacheManager): pass\n"
    )
    found = find_copies(COW, paths)
    _flagged(found, COW, NOT_WRITTEN)
    assert "start(...)" in found["fork"] and "cell 2" in found["fork"], found["fork"]


def test_a_kernel_notebook_with_its_exercise_cells_emptied_is_not_written(handout, tmp_path):
    _flagged(
        find_copies(KERNEL, _notebook(handout, "kernel", tmp_path, lambda _: "")),
        KERNEL,
        NOT_WRITTEN,
    )


def test_kernel_helpers_imported_from_the_reference_are_not_written(tmp_path):
    code = "from kernels.decode_attention import _attend_tile, _split_result\n"
    found = find_copies(KERNEL, _write(tmp_path, "decode_attention.py", code))
    _flagged(found, KERNEL, NOT_WRITTEN)
    assert "kernels.decode_attention" in found["tile"]


@pytest.mark.parametrize(
    "code",
    [
        pytest.param("    fork = KVCacheManager.fork\n", id="assigned_in_the_class"),
        pytest.param("    def fork(self, a, b):\n        return super().fork(a, b)\n", id="super"),
        pytest.param(
            "    def fork(self, a, b):\n        return Ref.fork(self, a, b)\n", id="ref_call"
        ),
    ],
)
def test_a_target_taken_from_the_reference_inside_a_class_is_not_written(code, tmp_path):
    text = (
        "from pagedlearn.core.kv_cache_manager import KVCacheManager\n"
        "from pagedlearn.core.kv_cache_manager import KVCacheManager as Ref\n"
        f"class KVCacheManager(KVCacheManager):\n{code}"
    )
    found = find_copies(COW, _write(tmp_path, "kv.py", text))
    assert "fork" in found and "KVCacheManager.fork" in found["fork"], found


def test_a_definition_that_only_one_branch_makes_still_counts_the_other(tmp_path):
    text = (
        "import os\nfrom pagedlearn.core.kv_cache_manager import KVCacheManager as R\n"
        "if os.environ.get('X'):\n    KVCacheManager = R\nelse:\n"
        "    class KVCacheManager:\n        def fork(self, a, b):\n            return 1\n"
        "KVCacheManager.append_token = R.append_token\n"
    )
    found = find_copies(COW, _write(tmp_path, "kv.py", text))
    assert {"fork", "cow"} <= set(found), found


# --- copies --------------------------------------------------------------------------------------
class _Rename(ast.NodeTransformer):
    """Renames a function's arguments and local variables (``x`` -> ``x_mine``)."""

    def visit_FunctionDef(self, fn: ast.FunctionDef) -> ast.FunctionDef:
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} - {"self"}
        local |= {
            n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and node.id in local:
                node.id += "_mine"
            elif isinstance(node, ast.arg) and node.arg in local:
                node.arg += "_mine"
        return fn


@pytest.mark.parametrize("lab_id", ["cow", "kernel", "allocator"])
def test_the_reference_with_its_locals_renamed_is_a_copy(lab_id, tmp_path):
    lab = get(lab_id)
    paths = []
    for name, source in lab_files(lab, blank=False).items():
        renamed = ast.unparse(_Rename().visit(ast.parse(source)))  # also reformatted, comments gone
        assert renamed != ast.unparse(ast.parse(source))
        paths += _write(tmp_path, name, renamed)
    found = find_copies(lab, paths)
    sizes = reference_bodies(lab)
    big = {ex.id for ex in lab.exercises if any(sizes[q][1] >= MIN_COPY_NODES for q in ex.targets)}
    assert set(found) == big and big, (found, big)
    for reason in found.values():
        assert "of the reference's (identical up to names)" in reason, reason


# --- what must not be flagged --------------------------------------------------------------------
@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_the_untouched_handout_is_neither_a_copy_nor_not_written(lab_id, handout):
    lab = get(lab_id)
    folder = handout / f"{lab.number:02d}_{lab_id}"
    assert find_copies(lab, [folder / Path(f).name for f in lab.files]) == {}
    assert find_copies(lab, sorted(folder.glob("*.ipynb"))) == {}


def test_a_correct_solution_of_its_own_is_not_flagged(tmp_path):
    files = filled(ALLOCATOR, HONEST_ALLOCATOR)
    sub = submit(ALLOCATOR, tmp_path, files)
    outcomes = grade_lab(ALLOCATOR, sub)
    assert all(o.status == PASSED for o in outcomes), [o.message for o in outcomes]  # correct
    assert find_copies(ALLOCATOR, [tmp_path / name for name in files]) == {}


def test_an_unreadable_submission_is_left_to_the_loader(tmp_path):
    paths = [*_write(tmp_path, "kv.py", "def broken(:\n"), tmp_path / "missing.py"]
    assert find_copies(COW, paths) == {}
