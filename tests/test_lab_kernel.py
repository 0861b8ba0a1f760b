"""The ``kernel`` lab's checks: each plausible mistake (a small patch to the reference) loses
points with a message naming it. (The reference's full marks and the untouched handout's 0 are
tested for every lab in ``test_labs.py``.)

The kernel runs in Triton's interpreter here (``conftest.py`` sets ``TRITON_INTERPRET=1``
without a GPU), with the student's helper swapped in.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("triton")

from helpers import grade_lab, lost_points, patched, submit

from pagedlearn.labs import get
from pagedlearn.labs.handout import exercise_code, lab_files
from pagedlearn.labs.runner import FAILED, NOT_DONE
from pagedlearn.labs.submission import load

LAB = get("kernel")
FILE = "decode_attention.py"
# What only Triton's interpreter does: run @triton.jit code without its source, stop a wild
# pointer before it is dereferenced, raise the student's own exception from their line.
interpreter_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's CPU interpreter"
)


@interpreter_only  # on a GPU, @triton.jit needs the cells' source (linecache): see submission.py
def test_a_notebook_of_exercise_cells_gets_full_marks(tmp_path):
    """The notebook's cells define only the helpers; the grader loads them without their
    source on disk, and each check still launches a kernel that calls them."""
    first = 'from pagedlearn.labs.feedback import start\ncheck = start("kernel", globals())\n'
    cells = [first] + [exercise_code(LAB, ex, blank=False) for ex in LAB.exercises]
    nb = {
        "cells": [{"cell_type": "code", "metadata": {}, "source": c} for c in cells],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "05_kernel.ipynb"
    path.write_text(json.dumps(nb))
    outcomes = grade_lab(LAB, load(LAB, [path]))
    assert [o.message for o in outcomes if not o.passed] == []


def test_a_stub_in_one_helper_leaves_the_other_exercise_gradable(tmp_path):
    text = lab_files(LAB, blank=True)[FILE]  # both stubs; put the reference's finish back
    ref_finish = lab_files(LAB, blank=False)[FILE].split("def _split_result")[1].split("\n\n\n")[0]
    stub_finish = text.split("def _split_result")[1].split("\n\n\n")[0]
    sub = submit(LAB, tmp_path, {FILE: text.replace(stub_finish, ref_finish)})
    assert all(o.passed for o in grade_lab(LAB, sub, "finish"))
    assert all(o.status == NOT_DONE for o in grade_lab(LAB, sub, "tile"))


# (exercise, old text, new text, a phrase some failing message of that exercise must contain)
MISTAKES = [
    pytest.param(
        "tile",
        '    s = tl.where(t_mask[None, :], s, float("-inf"))\n',
        "",
        "seem to count with score 0",
        id="unmasked_tail",
    ),
    pytest.param(
        "tile",
        "acc = acc * alpha[:, None] + tl.dot(",
        "acc = acc + tl.dot(",
        "must rescale both",
        id="acc_not_rescaled",
    ),
    pytest.param(
        "tile",
        "l_i = l_i * alpha + tl.sum(p, axis=1)",
        "l_i = l_i + tl.sum(p, axis=1)",
        "must rescale both",
        id="l_not_rescaled",
    ),
    pytest.param(
        "tile",
        "tl.load(table_row + pos // BLOCK_SIZE, mask",
        "tl.load(table_row + pos, mask",
        "t // BLOCK_SIZE",
        id="block_id_from_pos",
    ),
    pytest.param(
        "tile",
        "(pos % BLOCK_SIZE) * stride_slot",
        "pos * stride_slot",
        "t % BLOCK_SIZE",
        id="offset_is_pos",
    ),
    pytest.param(
        "tile",
        "tl.load(table_row + pos // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)",
        "(pos // BLOCK_SIZE).to(tl.int64)",
        "physical order",
        id="ignores_the_block_table",
    ),
    pytest.param(
        "tile",
        "m_new = tl.maximum(m_i, tl.max(s, axis=1))",
        "m_new = tl.max(s, axis=1)",
        "larger of the old max",
        id="m_new_without_the_old_max",
    ),
    pytest.param(
        "tile",
        "p = tl.exp(s - m_new[:, None])",
        "p = tl.exp(s)",
        "exp overflows",
        id="exp_without_subtracting_the_max",
    ),
    pytest.param(
        "tile",
        "input_precision=DOT_PRECISION) * scale",
        "input_precision=DOT_PRECISION)",
        "multiplied by scale",
        id="forgets_the_scale",
    ),
    pytest.param(
        "tile",
        "kv_offs = slot_offs[:, None] + head_off + offs_d[None, :]",
        "kv_offs = slot_offs[:, None] + offs_d[None, :]",
        "head_off",
        id="every_kv_head_reads_head_0",
    ),
    pytest.param(
        "finish",
        "out = acc / tl.where(has_keys, l_i, 1.0)[:, None]",
        "out = acc / l_i[:, None]",
        "without keys",
        id="divides_by_zero_without_keys",
    ),
    pytest.param(
        "finish",
        "m_i + tl.log(tl.where(has_keys, l_i, 1.0))",
        "m_i + tl.where(has_keys, l_i, 1.0)",
        "m_i + log(l_i)",
        id="lse_without_the_log",
    ),
]


@pytest.mark.parametrize(("exercise", "old", "new", "phrase"), MISTAKES)
def test_mistake_loses_points(tmp_path, exercise, old, new, phrase):
    sub = submit(LAB, tmp_path, patched(LAB, FILE, old, new))
    lost = lost_points(grade_lab(LAB, sub, exercise), phrase)
    assert all(o.status == FAILED for o in lost), [o.message for o in lost]


def test_an_off_by_one_mask_is_named_by_every_check_it_fails(tmp_path):
    """`pos <= end` reads the unwritten slot at `end` (NaN) in several checks; each must name the
    mask, from what it saw, not its own topic (rescaling, where a token lives)."""
    files = patched(LAB, FILE, "    t_mask = pos < end\n", "    t_mask = pos <= end\n")
    lost = lost_points(grade_lab(LAB, submit(LAB, tmp_path, files), "tile"), "pos <= end")
    assert len(lost) >= 3
    for o in lost:
        assert o.status == FAILED and "counts one position too many" in o.message, o.message
        assert "must rescale both" not in o.message and "t % BLOCK_SIZE" not in o.message


def test_the_rescale_hint_comes_only_from_an_unrescaled_output(tmp_path):
    """A finite wrong output fails the rescaling check too; it names rescaling only when the
    output is what a missing rescale gives (here every KV head reads head 0's keys)."""
    old = "kv_offs = slot_offs[:, None] + head_off + offs_d[None, :]"
    files = patched(LAB, FILE, old, "kv_offs = slot_offs[:, None] + offs_d[None, :]")
    outcomes = grade_lab(LAB, submit(LAB, tmp_path, files), "tile")
    failed = [o for o in outcomes if o.status == FAILED]
    assert any("rescales" in o.check for o in failed), [o.check for o in failed]
    assert not any("must rescale both" in o.message for o in failed), [o.message for o in failed]


@interpreter_only
def test_a_crash_in_the_helper_names_the_students_line(tmp_path):
    files = patched(LAB, FILE, "    t_mask = pos < end\n", "    t_mask = pos < undefined_name\n")
    outcome = grade_lab(LAB, submit(LAB, tmp_path, files), "tile")[0]
    assert outcome.status == FAILED
    assert "NameError" in outcome.message and f"{FILE}, line" in outcome.message


@interpreter_only
def test_a_wild_pointer_fails_the_check_instead_of_crashing(tmp_path):
    """In the interpreter a load outside the tensors would read wild memory, or end the
    process: the check stops it first and names the line."""
    old, new = "pos = tile_start + tl.arange(0, TILE_N)", "pos = tile_start - tl.arange(0, TILE_N)"
    files = patched(LAB, FILE, old, new)
    outcome = grade_lab(LAB, submit(LAB, tmp_path, files), "tile")[0]
    assert outcome.status == FAILED
    assert "would load memory outside every tensor it was given" in outcome.message
    assert f"{FILE}, line" in outcome.message
