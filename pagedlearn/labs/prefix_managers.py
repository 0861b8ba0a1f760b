"""Lab 3's shared harness: the student's prefix cache in messages, planted, and in a whole manager.

The ``prefix`` lab's checks (prefix.py) need a few tools they all share, gathered here so that
the checks read top to bottom:

- names for messages: ``name(h)`` shows a hash as ``ROOT_HASH``, ``H1``, ``H2`` (the two-block
  chain ``[1, 2]`` then ``[3, 4]`` the checks plant) or its first hex digits; ``call(...)`` shows
  a ``hash_block`` call with its extra keys in words (``salt 't1'``); ``attempt`` calls the
  student's code and turns a crash into a verdict naming the call and their line; ``_held``
  shows what a cache holds;
- ``chain`` (what ``hash_blocks`` must return), ``plant`` (index a prompt's full blocks with the
  *reference's* ``insert``, so a check of ``lookup`` or ``match`` does not depend on the
  student's ``insert``) and ``contents`` (everything a cache indexes, to compare two caches);
- ``_match``: the student's ``match`` alone -- on a planted cache, run with the reference's
  ``lookup`` -- after making sure their hashes are sound (else: do exercise ``hash`` first);
- the whole manager: :func:`your_manager` is a :class:`~pagedlearn.KVCacheManager` whose prefix
  cache (and block hashing) is the student's, and ``_Managers`` drives it beside the reference
  manager (:class:`~pagedlearn.labs.twins.Twins`): before each ``add_sequence`` it compares the
  cached tokens the two will reuse, and after every call their block tables, the blocks in the
  prefix cache, the allocator's LRU free queue and its evictions, with a hint that names the
  likely mistake when one differs.
"""

from __future__ import annotations

from pagedlearn.core import prefix_cache as ref
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.labs.lab import CheckFailed, crashed
from pagedlearn.labs.plug import your_kv_cache_manager
from pagedlearn.labs.remote import in_student
from pagedlearn.labs.twins import Held, Twins, ask

ROOT, E0 = ref.ROOT_HASH, ref.make_extra_keys()
SALT1, SALT2 = ref.make_extra_keys(cache_salt="t1"), ref.make_extra_keys(cache_salt="t2")
LORA = ref.make_extra_keys(adapter_id="lora")
KEYS = {E0: "()", SALT1: "salt 't1'", SALT2: "salt 't2'", LORA: "adapter 'lora'"}
try:  # a two-block chain the checks plant: [1, 2] then [3, 4]
    H1 = ref.hash_block(ROOT, [1, 2], E0)
    H2 = ref.hash_block(H1, [3, 4], E0)
except NotImplementedError:  # a student edition, where hash_block is a stub: only the grader
    H1 = H2 = None  # (which has the package) computes a verdict with these


def attempt(what: str, fn, *args):
    """Call the student's ``fn``; a crash becomes a verdict naming ``what`` and their line."""
    try:
        return fn(*args)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:
        raise crashed([what], e) from e


def name(h) -> str:
    """A hash in a message: the names the checks use, else its first hex digits."""
    if isinstance(h, bytes):
        return {ROOT: "ROOT_HASH", H1: "H1", H2: "H2"}.get(h, f"{h.hex()[:8]}..")
    return repr(h)[:60]


def call(fn: str, parent, tokens, extra) -> str:
    return f"{fn}({name(parent)}, {list(tokens)}, {KEYS.get(extra, extra)})"


def theirs(sub):
    """The student's ``hash_block``, with a crash reported as a verdict."""
    return lambda *args: attempt(call("hash_block", *args), sub.hash_block, *args)


def chain(hash_block, tokens, bs: int, extra) -> list[bytes]:
    """What ``hash_blocks`` must return, built with ``hash_block`` (theirs or the reference's)."""
    out: list[bytes] = []
    for j in range(len(tokens) // bs):
        out.append(hash_block(ROOT if j == 0 else out[-1], tokens[j * bs : (j + 1) * bs], extra))
    return out


def plant(cache, tokens, bs: int, blocks, extra=E0, skip=(), hash_block=ref.hash_block, sub=None):
    """Index ``tokens``' full blocks in ``cache`` as ``blocks`` (but the logical indices in
    ``skip``): in the reference's cache with its ``insert``; in the student's (``sub`` given)
    by writing its two dicts where their code runs, so that their insert is not needed yet."""
    hashes = chain(hash_block, tokens, bs, extra)
    entries = [
        (h, blocks[j], ref.parent_hash(hashes, j), tuple(tokens[j * bs : (j + 1) * bs]), extra)
        for j, h in enumerate(hashes)
        if j not in skip
    ]
    if sub is None:
        for entry in entries:
            ref.PrefixCache.insert(cache, *entry)
    else:
        in_student(sub, store, cache, entries)


def store(sub, cache, entries: list) -> None:
    """Write ``(hash, block, parent, tokens, extra keys)`` entries into a cache's ``_by_hash``
    and ``_hash_of`` (the two dicts every PrefixCache starts with), where the student's code
    runs."""
    for h, block, parent, tokens, extra in entries:
        if h not in cache._by_hash and block not in cache._hash_of:  # the first one keeps it
            cache._by_hash[h] = ref.CachedBlock(block, parent, tuple(tokens), tuple(extra))
            cache._hash_of[block] = h


def contents(cache) -> dict:
    """``{block: (parent, tokens, extra keys, hash)}``: everything a cache indexes."""
    return {e.block_id: (e.parent_hash, e.token_ids, e.extra_keys, h) for h, e in cache.items()}


def _match(sub, tokens, bs, plants, extra=E0, setup=""):
    """The student's ``match`` on their cache holding ``plants`` (``(tokens, blocks, extra,
    skip)``, hashed with their ``hash_block``), with their ``lookup``."""
    want, seen = chain(theirs(sub), tokens, bs, extra), {}
    if attempt(f"hash_blocks({tokens}, {bs}, ...)", sub.hash_blocks, tokens, bs, extra) != want:
        raise CheckFailed("match uses your hash_blocks: pass exercise 'hash' first")
    for p, e in [(tokens, extra)] + [(p[0], p[2] if len(p) > 2 else E0) for p in plants]:
        for j, h in enumerate(chain(theirs(sub), p, bs, e)):  # one hash, one content
            if seen.setdefault(h, (tuple(p[: (j + 1) * bs]), e)) != (tuple(p[: (j + 1) * bs]), e):
                raise CheckFailed("your hash_block gives two prefixes one hash: do 'hash' first")
    cache = attempt("PrefixCache()", sub.PrefixCache)
    for p in plants:
        plant(cache, p[0], bs, *p[1:], hash_block=sub.hash_block, sub=sub)
    before, what = contents(cache), f"match({tokens}, block_size={bs}, ...)"
    out = attempt(what, cache.match, tokens, bs, extra)
    if not isinstance(out, tuple) or len(out) != 2 or list(out[0]) != want:
        raise CheckFailed(
            f"{setup}{what} should return (hash_blocks(...), hits); yours: {out!r:.80}"
        )
    if contents(cache) != before:
        raise CheckFailed(f"{setup}{what} changed the cache: match must change nothing")
    return list(out[1])


def _held(cache, blocks) -> str:
    """A cache's entries and ``hash_of`` each of ``blocks``, as a message shows them."""
    have = ", ".join(
        f"{name(h)}: CachedBlock({b}, {name(p)}, {t!r:.30})"
        for b, (p, t, _, h) in contents(cache).items()
    )
    return "{" + have + "}" + "".join(f", hash_of({b}) = {name(cache.hash_of(b))}" for b in blocks)


# --- the whole manager on the student's prefix cache ----------------------------------------------
def your_manager(sub) -> type:
    """A ``KVCacheManager`` on the student's prefix cache, built as the notebook's last cell
    builds it (plug.py): filled blocks are hashed with *their* ``hash_block`` too."""
    sub.PrefixCache, sub.hash_block  # noqa: B018 -- a missing name is a verdict, not a KeyError
    return your_kv_cache_manager(prefix=sub, verbose=False)


def _cache_view(kv) -> dict:
    """``{block: tokens}`` of what a manager's cache indexes (with the salt, if any)."""
    out = {}
    for b, (_, tokens, extra, _) in sorted(contents(kv.prefix_cache).items()):
        salt = dict(extra).get("salt")
        out[b] = tokens + ((f"salt {salt!r}",) if salt is not None else ())
    return out


def _view(kv) -> dict:
    return {
        "block tables": {s: kv.block_table(s) for s in kv.sequences()},
        "blocks in the prefix cache (block: tokens)": _cache_view(kv),
        "free queue (LRU order, next allocation first)": kv.allocator.free_queue(),
        "num_evictions": kv.allocator.num_evictions,
    }


def _your_kv(sub, kwargs: dict) -> Held:
    """A manager on your prefix cache, built where your code runs."""
    return Held(your_manager(sub)(**kwargs), _look)


def _look(held: Held, before: bool = False):
    return None if before else _view(held.obj)


class _Managers(Twins):
    """The reference KVCacheManager and one on the student's prefix cache, driven alike."""

    def __init__(self, sub, num_blocks: int, block_size: int = 2) -> None:
        kw = {"num_blocks": num_blocks, "block_size": block_size, "enable_prefix_caching": True}
        setup = f"with KVCacheManager({', '.join(f'{k}={v}' for k, v in kw.items())})"
        super().__init__(setup, KVCacheManager(**kw), sub, _your_kv, kw)

    def call(self, name: str, *args):
        if name == "add_sequence":  # say a wrong hit before the manager acts on it
            want = self.ref.cached_prefix_tokens(*args[1:])
            got = attempt(
                f"cached_prefix_tokens{args[1:]!r}",
                in_student,
                self.sub,
                ask,
                self.yours,
                "cached_prefix_tokens",
                list(args[1:]),
            )
            if got != want:
                why = (
                    "finds more: a stale entry of an evicted block, a hit past a miss or on the "
                    "last token, another tenant's block?"
                    if got > want
                    else "misses cached blocks: are full blocks inserted and hashed alike?"
                )
                at = f"{self.where(self.ops)}: {name}{args!r}"
                raise self.fail(f"{at} should reuse {want} cached tokens; yours {got} ({why})")
        return super().call(name, *args)

    def snapshot(self, side: str) -> dict:
        return _view(self.ref)

    def state(self, obj):
        from pagedlearn.viz.state import pool_state

        return pool_state(obj)

    def hint(self, field: str, want, got, name: str) -> str:
        if field.startswith(("free queue", "num_evictions")):
            return (
                " (the manager marks a block cached, to be evicted last, when your insert "
                "returns True: return it only when the block was registered)"
            )
        if not field.startswith("blocks in"):
            return ""
        if extra := [b for b in got if got[b] != want.get(b)]:
            return (
                f" (block {extra[0]} is indexed in yours only: was its slot reused for new data "
                "(evicted) without forgetting its hash, or inserted under a hash another block "
                "holds?)"
            )
        return f" (block {next(b for b in want if b not in got)} is missing from yours)"
