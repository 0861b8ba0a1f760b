"""What the load test checks and measures beside the engine's own counters.

- :class:`TenantAudit` reads the block trace and catches a request served KV that another
  tenant computed. Each ``cache_store`` says which sequence -- so which request, so which
  tenant -- put its content into block ``b``; that tenant *owns* ``b``'s cached content until
  ``b`` is taken for other data (``evict``) or the cache is reset (``cache_reset``). A
  ``free`` changes nothing: a freed block stays findable. A ``cache_hit`` on ``b`` by a
  sequence of another tenant is a violation; so is a hit on a block with no recorded store
  (nobody can vouch for it), and a fork (``incref``) between two tenants. Every other hit is a
  same-tenant hit: a run must see some, or the isolation check judged nothing (a coverage
  check). A block handed out fresh
  (``allocate``, a ``cow_copy``'s destination) loses its owner too, so that a stale cache
  entry -- a hash still pointing at a block that now holds other data -- shows up as an
  unowned hit. (Not ``swap_in``: the samples of a request swap in together, and each one's
  event names the blocks they share, which the first one's swap-in stored already.)
- :func:`kv_waste` measures internal fragmentation: the share of the slots in the blocks that
  sequences hold where no token's K/V is::

      waste = 1 - tokens held / (blocks held x block_size)

  counting each block once however many sequences share it (a shared block holds the most
  tokens any of its holders has written into it). Only a sequence's last block can be partly
  empty, so the waste of one sequence is below ``block_size / its tokens``.

The verdicts that read them -- ``[OK]`` / ``[FAIL]`` / ``[--]`` -- are in loadtest/verdicts.py.

>>> from pagedlearn.trace.events import Event
>>> tenant = {"a": ("salt", "a"), "b": ("salt", "b")}.get
>>> audit = TenantAudit(tenant)
>>> for e in [Event(0, "cache_store", (5,), ("a.0",)), Event(1, "cache_hit", (5,), ("a.0",)),
...           Event(2, "cache_hit", (5,), ("b.0",))]:
...     audit(e)
>>> audit.same_tenant_hits, audit.cross_tenant_hits, audit.violations[0]["block"]
(1, 1, 5)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from pagedlearn.core.block_table import NULL_BLOCK
from pagedlearn.trace.block_events import split_group_seq_id

MAX_LISTED = 10  # violations kept with their details; the rest are only counted


def request_of(traced_id: Hashable) -> str:
    """The request id of a sequence id of the trace: ``"<request>.<i>"``, in a model with
    several KV-cache groups ``"<request>.<i>|<group>"``.

    >>> request_of("mix-3.1"), request_of("mix-3.0|sliding 24")
    ('mix-3', 'mix-3')
    """
    seq_id, _ = split_group_seq_id(traced_id)
    return str(seq_id).rsplit(".", 1)[0]


class TenantAudit:
    """Subscribe it to a trace (``engine.kv.trace.subscribe(audit)``) or call it on recorded
    events; ``tenant_of(request_id)`` names the tenant a request was sent as (any hashable;
    None for a request it never sent)."""

    def __init__(self, tenant_of: Callable[[str], Hashable]) -> None:
        self.tenant_of = tenant_of
        self.owner: dict[int, Hashable] = {}  # block -> tenant whose content it caches
        self.same_tenant_hits = 0  # blocks
        self.cross_tenant_hits = 0  # blocks: hits and forks across tenants, unowned hits
        self.violations: list[dict] = []  # the first MAX_LISTED, with what happened

    def __call__(self, event) -> None:
        kind, blocks = event.kind, event.blocks
        if kind == "cache_store":
            self.owner[blocks[0]] = self._tenant(event.seqs[0])
        elif kind == "cache_hit":
            who = self._tenant(event.seqs[0])
            for b in blocks:
                if b in self.owner and self.owner[b] == who:
                    self.same_tenant_hits += 1
                else:
                    self._violation(event, b, self.owner.get(b, "nobody"), who)
        elif kind == "incref":
            parent, child = (self._tenant(s) for s in event.seqs)
            if parent != child:
                for b in blocks:
                    self._violation(event, b, parent, child)
        elif kind in ("evict", "allocate", "cache_reset"):
            for b in blocks:  # new data (or no hash) in these blocks from now on
                self.owner.pop(b, None)
        elif kind == "cow_copy":
            self.owner.pop(blocks[1], None)

    def _tenant(self, traced_id: Hashable) -> Hashable:
        return self.tenant_of(request_of(traced_id))

    def _violation(self, event, block: int, owner, who) -> None:
        self.cross_tenant_hits += 1
        if len(self.violations) < MAX_LISTED:
            self.violations.append(
                {
                    "event": event.index,
                    "kind": event.kind,
                    "block": block,
                    "seq": str(event.seqs[-1]),
                    "owner": repr(owner),
                    "tenant": repr(who),
                }
            )

    def as_dict(self) -> dict:
        return {
            "same_tenant_hit_blocks": self.same_tenant_hits,
            "cross_tenant_hit_blocks": self.cross_tenant_hits,
            "violations": list(self.violations),
        }


def kv_waste(kv) -> tuple[int, int]:
    """``(tokens held, slots held)`` in the GPU blocks the sequences of ``kv`` (a
    KVCacheManager or a KVCacheCoordinator) hold now; waste = 1 - tokens / slots (see the
    module docstring). Swapped-out sequences hold no GPU block. Between engine steps a running
    sequence holds every token but its newest (sampled, not yet fed back).

    >>> from pagedlearn import KVCacheManager
    >>> kv = KVCacheManager(num_blocks=8, block_size=4)
    >>> kv.add_sequence("a", [1, 2, 3, 4, 5]); kv.fork("a", "b")  # blocks 0 (full), 1 (1 token)
    0
    >>> kv_waste(kv)  # 5 tokens in 2 blocks of 4 slots: the fork shares both
    (5, 8)
    """
    bs, filled = kv.block_size, {}
    for seq_id in kv.sequences():
        n = kv.num_tokens(seq_id)
        for table in kv.block_tables(seq_id):
            for j, b in enumerate(table):
                if b != NULL_BLOCK:  # a block a sliding window has let go
                    filled[b] = max(filled.get(b, 0), min(bs, n - j * bs))
    return sum(filled.values()), len(filled) * bs
