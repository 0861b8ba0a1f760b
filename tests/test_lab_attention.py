"""The ``attention`` lab's checks: each plausible mistake (a small patch to the reference) loses
points with a message naming it. (The reference's full marks and the untouched handout's 0 are
tested for every lab in ``test_labs.py``.)"""

from __future__ import annotations

import pytest
from helpers import grade_lab, lost_points, patched, submit

from pagedlearn.labs import get
from pagedlearn.labs.handout import exercise_code
from pagedlearn.labs.runner import FAILED, run_check

LAB = get("attention")
FILE = "references.py"


def test_exercise_cells_alone_get_full_marks():
    """As in the notebook: the cells define only the targets, over the reference's names."""
    from pagedlearn.labs.feedback import given
    from pagedlearn.labs.submission import Submission

    ns = {**given("attention"), "check": lambda exercise: None}
    for ex in LAB.exercises:
        exec(compile(exercise_code(LAB, ex, blank=False), f"cell {ex.id}", "exec"), ns)
    outcomes = grade_lab(LAB, Submission(ns, "cells"))
    assert [o.message for o in outcomes if not o.passed] == []


# (exercise, old text, new text, a phrase some failing message of that exercise must contain)
MISTAKES = [
    pytest.param(
        "online",
        "                alpha = torch.exp(m_i - m_new)  # exp(-inf) = 0 on the first block\n"
        "                p = torch.exp(s - m_new[:, None])  # (num_heads, valid)\n",
        "                alpha = torch.ones_like(m_i)\n                p = torch.exp(s)\n",
        "exp overflows float32",
        id="no_running_max",
    ),
    pytest.param(
        "online",
        "acc = acc * alpha[:, None] + torch.einsum",
        "acc = acc + torch.einsum",
        "must be multiplied by exp(m_old - m_new)",
        id="acc_not_rescaled",
    ),
    pytest.param(
        "online",
        'acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v)',
        'acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p / p.sum(1, True), v)',
        "divide acc by l once",
        id="divides_per_block",
    ),
    pytest.param(
        "online",
        "valid = min(bs, n - j * bs)",
        "valid = bs",
        "seems to be read in full",
        id="unmasked_tail",
    ),
    pytest.param(
        "online",
        "        num_blocks = -(-n // bs)\n",
        "        num_blocks = n // bs\n",
        "seems to be skipped",
        id="floor_number_of_blocks",
    ),
    pytest.param(
        "online",
        "k = k.repeat_interleave(group, dim=1)  # each KV head serves `group` query heads\n"
        "                v = v.repeat_interleave(group, dim=1)",
        "k = k.repeat(1, group, 1)\n                v = v.repeat(1, group, 1)",
        "repeat_interleave, not repeat",
        id="gqa_repeat_instead_of_repeat_interleave",
    ),
    pytest.param(
        "online",
        "w = torch.exp(m_all - m_max)",
        "w = torch.ones_like(m_all)",
        "weights slice s",
        id="splits_merged_without_weights",
    ),
    pytest.param(
        "online",
        "block_id = int(block_tables[i, j])",
        "block_id = j",
        "physical order",
        id="online_ignores_the_block_table",
    ),
    pytest.param(
        "online",
        "safe_l = torch.where(l_total > 0, l_total, torch.ones_like(l_total))",
        "safe_l = l_total",
        "no keys gets zeros",
        id="empty_context_divides_by_zero",
    ),
    pytest.param(
        "gather",
        "    ids = block_table[:num_blocks].long()",
        "    ids = torch.arange(num_blocks)",
        "physical order",
        id="gather_ignores_the_block_table",
    ),
    pytest.param(
        "gather",
        "contiguous_attention(q[i : i + 1], k, v, shape.scale)[0]",
        "contiguous_attention(q[i : i + 1], k, v)[0]",
        "pass shape.scale on",
        id="paged_ref_drops_the_scale",
    ),
    pytest.param(
        "gather",
        "    num_blocks = -(-context_len // block_size)",
        "    num_blocks = context_len // block_size",
        "should have shape",
        id="gather_floor_number_of_blocks",
    ),
    pytest.param(
        "write",
        "keep = slot_mapping >= 0",
        "keep = slot_mapping >= -1",
        "padding",
        id="writes_negative_slots",
    ),
    pytest.param(
        "write",
        "blocks, offsets = slots // shape.block_size, slots % shape.block_size",
        "offsets, blocks = slots // shape.block_size, slots % shape.block_size",
        "should be at key_cache",
        id="write_swaps_block_and_row",
    ),
    pytest.param(
        "write",
        "value_cache, slot_mapping, check_values)",
        "value_cache, slot_mapping, False)",
        "should raise AttentionInputError",
        id="write_without_checking_slots",
    ),
]


@pytest.mark.parametrize(("exercise", "old", "new", "phrase"), MISTAKES)
def test_mistake_loses_points(tmp_path, exercise, old, new, phrase):
    sub = submit(LAB, tmp_path, patched(LAB, FILE, old, new))
    lost_points(grade_lab(LAB, sub, exercise), phrase)


def test_failure_names_the_sequence_and_its_blocks(tmp_path):
    files = patched(LAB, FILE, "valid = min(bs, n - j * bs)", "valid = bs")
    check = next(c for c in LAB.checks if c.name == "online_partial_last_block")
    outcome = run_check(check, submit(LAB, tmp_path, files))
    assert outcome.status == FAILED
    assert "sequence 0 (context 5, block_size 4, blocks [" in outcome.message
    assert "seems to be read in full" in outcome.message
