import ast
import os
import subprocess
import sys
from pathlib import Path

from pagedlearn.core.prefix_cache import ROOT_HASH, PrefixCache, hash_block, make_extra_keys

EXTRA = make_extra_keys("model-a")


def test_hash_depends_on_parent_tokens_and_extra_keys():
    h = hash_block(ROOT_HASH, [1, 2, 3, 4], EXTRA)
    assert len(h) == 32
    assert h == hash_block(ROOT_HASH, [1, 2, 3, 4], EXTRA)
    assert h != hash_block(ROOT_HASH, [1, 2, 3, 5], EXTRA)
    assert h != hash_block(h, [1, 2, 3, 4], EXTRA)  # same tokens after a different prefix
    assert h != hash_block(ROOT_HASH, [1, 2, 3, 4], make_extra_keys("model-b"))
    assert h != hash_block(ROOT_HASH, [1, 2, 3, 4], make_extra_keys("model-a", adapter_id="lora"))
    assert h != hash_block(ROOT_HASH, [1, 2, 3, 4], make_extra_keys("model-a", cache_salt="t1"))
    assert hash_block(ROOT_HASH, [1, 2], EXTRA) != hash_block(ROOT_HASH, [1, 2, 0], EXTRA)


def test_hash_is_the_same_in_every_process():
    # Built-in hash() is salted per process for str; a block hash must not be.
    code = (
        "from pagedlearn.core.prefix_cache import *; "
        "print(hash_block(ROOT_HASH, [1, 2], make_extra_keys('m', 'a', 'salt')).hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    assert len(outs) == 1
    expected = hash_block(ROOT_HASH, [1, 2], make_extra_keys("m", "a", "salt")).hex()
    assert outs.pop().strip() == expected


def test_builtin_hash_is_not_used_anywhere_in_the_package():
    root = Path(__file__).parent.parent / "pagedlearn"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hash":
                raise AssertionError(f"{path}:{node.lineno} calls built-in hash()")


def test_lookup_verifies_content_so_a_collision_is_a_miss():
    cache = PrefixCache()
    h = hash_block(ROOT_HASH, [1, 2], EXTRA)
    assert cache.insert(h, 7, ROOT_HASH, [1, 2], EXTRA)
    assert cache.lookup(h, ROOT_HASH, [1, 2], EXTRA) == 7
    # Pretend another content hashed to h: the stored tokens / parent / keys decide.
    assert cache.lookup(h, ROOT_HASH, [1, 3], EXTRA) is None
    assert cache.lookup(h, b"\0" * 32, [1, 2], EXTRA) is None
    assert cache.lookup(h, ROOT_HASH, [1, 2], make_extra_keys("other")) is None


def test_first_block_under_a_hash_keeps_it_and_evict_forgets_both_ways():
    cache = PrefixCache()
    h = hash_block(ROOT_HASH, [1, 2], EXTRA)
    assert cache.insert(h, 3, ROOT_HASH, [1, 2], EXTRA)
    assert not cache.insert(h, 4, ROOT_HASH, [1, 2], EXTRA)  # a second copy is not indexed
    assert cache.hash_of(3) == h and cache.hash_of(4) is None and len(cache) == 1
    assert cache.evict(4) is None
    assert cache.evict(3) == h
    assert cache.lookup(h, ROOT_HASH, [1, 2], EXTRA) is None and len(cache) == 0
