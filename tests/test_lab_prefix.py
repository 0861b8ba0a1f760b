"""The ``prefix`` lab's checks: the reference gets full marks, the untouched handout none, and
each plausible mistake (a small patch to the reference) loses points with a message naming it."""

from __future__ import annotations

import pytest

from pagedlearn.labs import get
from pagedlearn.labs.handout import lab_files
from pagedlearn.labs.prefix import your_manager
from pagedlearn.labs.runner import FAILED, NOT_DONE, PASSED, run_check
from pagedlearn.labs.submission import load, reference
from pagedlearn.prefix_cache import ROOT_HASH, hash_block, make_extra_keys

LAB = get("prefix")
FILE = "prefix_cache.py"


def grade(sub):
    return [run_check(c, sub) for c in LAB.checks]


def write(tmp_path, text: str) -> list:
    (tmp_path / FILE).write_text(text)
    return [tmp_path / FILE]


def patched(old: str, new: str) -> str:
    text = lab_files(LAB, blank=False)[FILE]
    assert text.count(old) == 1, f"the patch no longer applies to {FILE}"
    return text.replace(old, new)


def test_lab_is_well_formed():
    assert LAB.number == 3 and 8 <= len(LAB.checks) <= 15
    assert all(1 <= c.points <= 3 for c in LAB.checks)
    assert {c.exercise for c in LAB.checks} == {"hash", "lookup", "evict"}


def test_reference_gets_full_marks():
    outcomes = grade(reference(LAB))
    assert [o.message for o in outcomes if not o.passed] == []
    assert sum(o.score for o in outcomes) == LAB.max_score


def test_handout_gets_nothing(tmp_path):
    outcomes = grade(load(LAB, write(tmp_path, lab_files(LAB, blank=True)[FILE])))
    assert sum(o.score for o in outcomes) == 0
    assert {o.status for o in outcomes} <= {NOT_DONE, FAILED}
    assert all("prefix: " in o.message for o in outcomes if o.status == NOT_DONE)


# (old text, new text, a phrase the failing message must contain)
MISTAKES = [
    pytest.param(
        "h = hashlib.sha256(parent_hash)",
        "h = hashlib.sha256()",
        "must chain on its parent",
        id="hash_without_parent",
    ),
    pytest.param(
        "hashes.append(hash_block(parent_hash(hashes, j), tokens, extra_keys))",
        "hashes.append(hash_block(ROOT_HASH, tokens, extra_keys))",
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
        "for j in range(len(token_ids) // block_size):",
        "for j in range(-(-len(token_ids) // block_size)):",
        "the partial tail",
        id="hashes_the_partial_tail",
    ),
    pytest.param(
        "tokens = token_ids[j * block_size : (j + 1) * block_size]\n        hashes",
        "tokens = token_ids[j * block_size : (j + 1) * block_size + 1]\n        hashes",
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
    outcomes = grade(load(LAB, write(tmp_path, patched(old, new))))
    lost = [o for o in outcomes if o.status != PASSED]
    assert lost, "this mistake gets full marks"
    assert any(phrase in o.message for o in lost), [o.message for o in lost]


def test_manager_failure_has_a_picture(tmp_path):
    text = patched("            del self._by_hash[block_hash]\n", "            pass\n")
    sub = load(LAB, write(tmp_path, text))
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
    outcomes = grade(sub)
    assert any("salt 't2'" in o.message for o in outcomes if o.status == FAILED)
