import pytest

from pagedlearn.core.block_table import BlockTable


def test_slot_formula_on_the_seed_example():
    # A 12-token request in physical blocks 7, 2, 11 with block_size 4.
    t = BlockTable(4, block_ids=[7, 2, 11], token_ids=list(range(12)))
    assert t.slot_mapping() == [28, 29, 30, 31, 8, 9, 10, 11, 44, 45, 46, 47]
    assert [t.slot(i) for i in range(12)] == t.slot_mapping()
    for i in range(12):
        assert t.slot(i) == t.block_ids[i // 4] * 4 + i % 4


def test_partial_last_block_and_counts():
    t = BlockTable(4, block_ids=[7, 2, 11], token_ids=list(range(10)))
    assert t.num_tokens == 10 and t.num_full_blocks == 2
    assert t.slot(9) == 45
    assert t.block_tokens(2) == [8, 9]
    with pytest.raises(IndexError):
        t.slot(10)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4), (17, 5)])
def test_blocks_needed_is_ceil(tokens, blocks):
    assert BlockTable(4).blocks_needed(tokens) == blocks


def test_copy_is_independent():
    t = BlockTable(2, block_ids=[3], token_ids=[1])
    c = t.copy()
    c.block_ids.append(5)
    c.token_ids.append(2)
    assert t.block_ids == [3] and t.token_ids == [1]
