"""The ``allocator`` lab's checks: each plausible mistake (a small patch to the reference) loses
points with a message naming it. (The reference's full marks and the untouched handout's 0 are
tested for every lab in ``test_labs.py``.)"""

from __future__ import annotations

import pytest
from helpers import grade_lab, lost_points, patched, submit

from pagedlearn.labs import get
from pagedlearn.labs.handout import lab_files
from pagedlearn.labs.runner import FAILED, run_check

LAB = get("allocator")
POOL, TABLE = "block_allocator.py", "block_table.py"


# (file, old text, new text, a phrase the failing message must contain)
MISTAKES = [
    pytest.param(
        POOL,
        "self._free_cached.popitem(last=False)",
        "self._free_cached.popitem(last=True)",
        "least recently freed first",
        id="evicts_mru",
    ),
    pytest.param(
        POOL,
        "        if n <= len(empty):  # the common case",
        "        if n <= len(empty) and not self._free_cached:  # the common case",
        "taken first",
        id="takes_cached_before_empty",
    ),
    pytest.param(
        POOL,
        "        elif n > self.num_free_blocks:\n"
        "            raise OutOfBlocksError(n, self.num_free_blocks, self._num_blocks)\n"
        "        else:  # every empty block, then cached ones, least recently used first: evicted\n"
        "            ids = list(empty)\n            empty.clear()\n",
        "        else:\n            ids = list(empty)\n            empty.clear()\n"
        "            if n > len(ids) + len(self._free_cached):\n"
        "                raise OutOfBlocksError(n, len(ids), self._num_blocks)\n",
        "all or nothing",
        id="allocate_not_all_or_nothing",
    ),
    pytest.param(
        POOL,
        "        if count:\n"
        "            for b, times in Counter(ids).items():\n"
        "                if times > refs[b]:\n"
        "                    raise PagedLearnError(\n"
        '                        f"double free: block {b} freed {times}x but has refcount '
        '{refs[b]}"\n'
        "                    )\n",
        "        for b in ids:\n"
        "            if refs[b] == 0:  # checked as it goes\n"
        "                raise PagedLearnError(f'double free of block {b}')\n"
        "            refs[b] -= 1\n",
        "an error must leave everything as it was",
        id="double_free_partly_applied",
    ),
    pytest.param(
        POOL,
        "                if times > refs[b]:",
        "                if times > refs[b] + 1:",
        "should raise PagedLearnError (double free",
        id="double_free_undetected",
    ),
    pytest.param(
        POOL,
        "                if b in cached:\n                    lru[b] = None",
        "                if False:\n                    lru[b] = None",
        "the free queue (next allocation first) should be",
        id="cached_block_freed_into_empty_queue",
    ),
    pytest.param(
        POOL,
        "            if refs[b] == 0:\n                del self._free_cached[b]",
        "            if False:\n                del self._free_cached[b]",
        "refcount is 0",
        id="incref_leaves_cached_block_in_free_queue",
    ),
    pytest.param(
        POOL,
        "or (refs[b] == 0 and b not in cached):\n"
        "                self._check_ids(ids)  # raises, naming the first bad id\n"
        "                if refs[b] == 0 and b not in cached:",
        "or refs[b] < 0:\n"
        "                self._check_ids(ids)  # raises, naming the first bad id\n"
        "                if refs[b] < 0:",
        "should raise PagedLearnError (incref of block",
        id="incref_of_free_empty_block",
    ),
    pytest.param(
        POOL,
        "            elif refs[b] == 1:\n                self._num_shared += 1\n",
        "",
        "num_shared_blocks",
        id="num_shared_not_maintained",
    ),
    pytest.param(
        POOL,
        "            self._refcounts[b] = 1\n",
        "            pass\n",
        "refcounts of blocks",
        id="allocate_leaves_refcount_0",
    ),
    pytest.param(
        POOL,
        "                self.num_evictions += 1\n",
        "",
        "num_evictions",
        id="eviction_not_counted",
    ),
    pytest.param(
        POOL,
        "                self._cached.discard(block_id)\n",
        "",
        "cached blocks",
        id="evicted_block_still_cached",
    ),
    pytest.param(
        TABLE,
        "return -(-num_tokens // self.block_size)",
        "return num_tokens // self.block_size",
        "part of one more",
        id="blocks_needed_floor_division",
    ),
    pytest.param(
        TABLE,
        "* self.block_size + i % self.block_size",
        "* self.block_size + i % self.block_size + 1",
        "offset",
        id="off_by_one_slot",
    ),
    pytest.param(
        TABLE,
        "self.block_ids[i // self.block_size] * self.block_size + i % self.block_size",
        "self.block_ids[i % len(self.block_ids)] * self.block_size + i // self.block_size",
        "logical block",
        id="slot_mixes_block_and_offset",
    ),
    pytest.param(
        TABLE,
        "if not 0 <= i < self.num_tokens:",
        "if i >= self.num_tokens:",
        "should raise IndexError",
        id="slot_accepts_negative_positions",
    ),
]


@pytest.mark.parametrize(("file", "old", "new", "phrase"), MISTAKES)
def test_mistake_loses_points(tmp_path, file, old, new, phrase):
    sub = submit(LAB, tmp_path, patched(LAB, file, old, new))
    lost_points(grade_lab(LAB, sub), phrase)


def test_failure_has_a_picture(tmp_path):
    files = lab_files(LAB, blank=False)
    files[POOL] = files[POOL].replace("popitem(last=False)", "popitem(last=True)")
    sub = submit(LAB, tmp_path, files)
    check = next(c for c in LAB.checks if c.name.startswith("cached_blocks_are_evicted"))
    outcome = run_check(check, sub)
    assert outcome.status == FAILED and outcome.picture is not None
    fig = outcome.picture()
    assert len(fig.axes) == 2  # yours, the reference
