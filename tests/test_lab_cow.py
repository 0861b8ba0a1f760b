"""The ``cow`` lab's checks: each plausible mistake (a small patch to the reference) loses
points with a message naming it. (The reference's full marks and the untouched handout's 0 are
tested for every lab in ``test_labs.py``.)"""

from __future__ import annotations

import pytest
from helpers import grade_lab, lost_points, patched, submit

from pagedlearn.labs import get
from pagedlearn.labs.runner import FAILED, run_check

LAB = get("cow")
KV = "kv_cache_manager.py"
ALLOCATE_DST = '            (dst,) = self._allocate(1, seq_id, f"copy-on-write for {seq_id!r}")'
RETURN_SLOT = "        return table.block_ids[-1] * self.block_size + pos % self.block_size"
FREE_SRC = (
    "            self.allocator.free([src])  # one sharer fewer; the others keep src untouched"
)


# (old text, new text, a phrase the failing message must contain), all in kv_cache_manager.py
NULLS = (
    "        blocks = parent.live_blocks()  # a sliding window's null entries stay null in both\n"
)
MISTAKES = [
    pytest.param(
        "        self.allocator.incref(blocks)\n"
        "        self._seqs.add(child_id, parent.copy(), self._seqs.extra_keys[parent_id])\n",
        "        table = parent.copy()\n"
        "        table.block_ids = self._allocate(len(parent.block_ids), child_id)\n"
        "        self._copies.extend(zip(parent.block_ids, table.block_ids))\n"
        "        self._seqs.add(child_id, table, self._seqs.extra_keys[parent_id])\n",
        "fork copies no KV",
        id="copies_on_fork",
    ),
    pytest.param(  # checks sharing before the boundary: a shared full block is copied too
        "        if pos % self.block_size == 0:  # the last block is full (or there is none): a "
        "new one\n",
        "        if table.block_ids and self.allocator.refcount(table.block_ids[-1]) > 1:\n"
        "            src = table.block_ids[-1]\n"
        "            (dst,) = self._allocate(1, seq_id)\n"
        "            self.allocator.free([src])\n"
        "            table.block_ids[-1] = dst\n"
        "            self._copies.append((src, dst))\n"
        "            self._counters['cow_copies'] += 1\n"
        "            self._events.cow_copy(seq_id, src, dst)\n"
        "        if pos % self.block_size == 0:\n",
        "a full last block gets a new one",
        id="copies_a_full_shared_block",
    ),
    pytest.param(
        "            self.allocator.free([src])  # one sharer fewer",
        "            pass  # one sharer fewer",
        "refcounts of blocks",
        id="keeps_the_reference_on_src",
    ),
    pytest.param(
        "        elif self.allocator.refcount(src := table.block_ids[-1]) > 1:",
        "        elif self.allocator.refcount(src := table.block_ids[-1]) > 0:",
        "yours copied a block",
        id="last_sharer_copies_anyway",
    ),
    pytest.param(
        f"{ALLOCATE_DST}\n{FREE_SRC}\n",
        f"{FREE_SRC}\n{ALLOCATE_DST}\n",
        "an error must leave everything as it was",
        id="frees_src_before_allocating",
    ),
    pytest.param(
        "live_blocks()[::-1]",
        "live_blocks()[:]",
        "LAST block first",
        id="frees_head_first",
    ),
    pytest.param(
        RETURN_SLOT,
        RETURN_SLOT + " + 1",
        "should return",
        id="off_by_one_slot",
    ),
    pytest.param(
        RETURN_SLOT,
        "        return pos",
        "the slot is block * block_size + offset",
        id="returns_the_position_not_the_slot",
    ),
    pytest.param(
        "        self._seqs.check_new(child_id)\n",
        "",
        "should raise PagedLearnError (sequence id 'a' already exists)",
        id="fork_does_not_check_the_child",
    ),
    pytest.param(
        "        self._seqs.check_new(child_id)\n"
        + NULLS
        + "        self.allocator.incref(blocks)\n",
        NULLS + "        self.allocator.incref(blocks)\n        self._seqs.check_new(child_id)\n",
        "an error must leave everything as it was",
        id="fork_checks_the_child_too_late",
    ),
    pytest.param(
        "            self._cache_full_block(seq_id, table)\n",
        "            pass\n",
        "must be registered",
        id="forgets_to_cache_a_full_block",
    ),
    pytest.param(
        "            self._events.cow_copy(seq_id, src, dst)\n",
        "",
        "trace events",
        id="no_cow_copy_event",
    ),
    pytest.param(
        "min(k, self.allocator.refcount(b) - 1)",
        "k",
        "blocks_to_append(['a', 'b', 'c']) should return 2",
        id="plan_counts_k_copies",
    ),
    pytest.param(
        "min(k, self.allocator.refcount(b) - 1)",
        "min(k, self.allocator.refcount(b))",
        "should return",
        id="plan_ignores_the_last_sharer",
    ),
]


@pytest.mark.parametrize(("old", "new", "phrase"), MISTAKES)
def test_mistake_loses_points(tmp_path, old, new, phrase):
    sub = submit(LAB, tmp_path, patched(LAB, KV, old, new))
    lost_points(grade_lab(LAB, sub), phrase)


def test_failure_has_a_picture_of_both_pools(tmp_path):
    files = patched(LAB, KV, "live_blocks()[::-1]", "live_blocks()[:]")
    check = next(c for c in LAB.checks if c.name == "free_sequence_frees_the_tail_first")
    outcome = run_check(check, submit(LAB, tmp_path, files))
    assert outcome.status == FAILED and outcome.picture is not None
    assert len(outcome.picture().axes) == 2
