"""The ``prefix`` lab's checks: each plausible mistake (a small patch to the reference) loses
points with a message naming it. (The reference's full marks and the untouched handout's 0 are
tested for every lab in ``test_labs.py``.)"""

from __future__ import annotations

import pytest
from helpers import grade_lab, lost_points, patched, submit

from pagedlearn.core.prefix_cache import ROOT_HASH, hash_block, make_extra_keys
from pagedlearn.labs import get
from pagedlearn.labs.prefix import your_manager
from pagedlearn.labs.runner import FAILED, run_check
from pagedlearn.labs.submission import load

LAB = get("prefix")
FILE = "prefix_cache.py"


# (old text, new text, a phrase the failing message must contain)
MISTAKES = [
    pytest.param(
        "h = hashlib.sha256(parent_hash)",
        "h = hashlib.sha256()",
        "must chain on its parent",
        id="hash_without_parent",
    ),
    pytest.param(
        "parent = hash_block(parent, token_ids[first : first + block_size], extra_keys)",
        "parent = hash_block(ROOT_HASH, token_ids[first : first + block_size], extra_keys)",
        "chains it on ROOT_HASH instead",
        id="chain_every_block_on_root",
    ),
    pytest.param(
        "    h.update(repr(extra_keys).encode())\n",
        "",
        "extra keys must be hashed too",
        id="extra_keys_ignored",
    ),
    pytest.param(
        'struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)',
        "str(list(token_ids)).encode()",
        "the package's serialisation",
        id="own_serialisation",
    ),
    pytest.param(
        "for first in range(0, len(token_ids) - block_size + 1, block_size):",
        "for first in range(0, len(token_ids), block_size):",
        "the partial tail",
        id="hashes_the_partial_tail",
    ),
    pytest.param(
        "parent = hash_block(parent, token_ids[first : first + block_size], extra_keys)",
        "parent = hash_block(parent, token_ids[first : first + block_size + 1], extra_keys)",
        "block 0 should be hash_block(ROOT_HASH, [0]",
        id="off_by_one_block_slice",
    ),
    pytest.param(
        "            and entry.token_ids == tuple(token_ids)\n",
        "",
        "A hash collision must cost a miss",
        id="lookup_trusts_the_hash",
    ),
    pytest.param(
        "            and entry.extra_keys == extra_keys\n",
        "",
        "other extra keys",
        id="lookup_ignores_extra_keys",
    ),
    pytest.param(
        "            if block is None:\n                break",
        "            if block is None:\n                continue",
        "to the first miss",
        id="match_skips_a_miss",
    ),
    pytest.param(
        "for j in range((len(token_ids) - 1) // block_size):",
        "for j in range(len(token_ids) // block_size):",
        "the last token is always computed",
        id="match_covers_the_last_token",
    ),
    pytest.param(
        "        if block_hash in self._by_hash or block_id in self._hash_of:",
        "        if block_id in self._hash_of:",
        "the first block stored under a hash keeps it",
        id="insert_overwrites",
    ),
    pytest.param(
        "        if block_hash is not None:\n            del self._by_hash[block_hash]\n",
        "",
        "stale",
        id="evict_keeps_the_hash_entry",
    ),
    pytest.param(
        "        if block_hash in self._by_hash or block_id in self._hash_of:\n"
        "            return False",
        "        if block_hash in self._by_hash or block_id in self._hash_of:\n"
        "            return True",
        "should return False",
        id="insert_reports_a_skipped_block",
    ),
]


@pytest.mark.parametrize(("old", "new", "phrase"), MISTAKES)
def test_mistake_loses_points(tmp_path, old, new, phrase):
    sub = submit(LAB, tmp_path, patched(LAB, FILE, old, new))
    lost_points(grade_lab(LAB, sub), phrase)


def test_manager_failure_has_a_picture(tmp_path):
    files = patched(LAB, FILE, "            del self._by_hash[block_hash]\n", "            pass\n")
    sub = submit(LAB, tmp_path, files)
    check = next(c for c in LAB.checks if c.name == "evicted_blocks_give_no_stale_hits")
    outcome = run_check(check, sub)
    assert outcome.status == FAILED and "block 0 is indexed in yours only" in outcome.message
    assert len(outcome.picture().axes) == 2  # yours, the reference


def test_a_notebook_submission_hashes_filled_blocks_with_its_own_hash_block(tmp_path):
    # In a notebook, PrefixCache.hash_block is inherited from the reference and would call the
    # reference's hash_block: the whole-manager checks must use the notebook's own.
    import jupytext

    from pagedlearn.labs.notebooks import lab_notebook

    nb = jupytext.read(lab_notebook("prefix"))
    cell = next(c for c in nb.cells if c.source.startswith("# Exercise 'hash'"))
    assert cell.source.count("    h.update(repr(extra_keys).encode())\n") == 1
    cell.source = cell.source.replace("    h.update(repr(extra_keys).encode())\n", "")
    jupytext.write(nb, tmp_path / "03_prefix.ipynb", fmt="ipynb")
    sub = load(LAB, [tmp_path / "03_prefix.ipynb"])
    kv = your_manager(sub)(4, 2, enable_prefix_caching=True)
    salted = make_extra_keys(cache_salt="t1")
    theirs = kv.prefix_cache.hash_block(ROOT_HASH, [1, 2], salted)
    assert theirs == sub.hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [1, 2], salted)
    outcomes = grade_lab(LAB, sub)
    assert any("salt 't2'" in o.message for o in outcomes if o.status == FAILED)
