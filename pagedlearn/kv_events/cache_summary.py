"""The cache a KV-event stream describes, in numbers and words: for the terminal and the views.

:func:`summarize` reads a :class:`~pagedlearn.kv_events.cache_state.KVCacheState` into a
:class:`CacheSummary` (blocks per medium and group, the tree's depth, the shared prefixes, the
problems met); :func:`hit_opportunities` tells how much of a new prompt is cached now, two ways:

- **by tokens**: the events carry each block's tokens, so the prompt is walked down the tree from
  the prompts' first blocks, block by block. This needs nothing the stream does not say -- but a
  block cached with a LoRA adapter, images or a cache salt would not be shared with a plain
  prompt, so blocks whose event names such keys are not matched (``keyed_skipped``).
- **by hash**: the prompt's hashes computed as the server computes them (a hasher from
  :mod:`~pagedlearn.kv_events.block_hashes`) and looked up. Exact when the algorithm, the root
  seed and the extra keys are the server's -- none of which is in the stream. A hash count below
  the token count says that one of them is wrong.

Either way at most ``(len(prompt) - 1) // block_size`` blocks can be reused: the last prompt token
is always computed, to get the next token's logits (vLLM and pagedlearn cap it the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events.block_hashes import UNKNOWABLE
from pagedlearn.kv_events.cache_state import BlockKey, KVCacheState, StoredBlock, short

PREVIEW_TOKENS = 6  # token ids shown per prefix, without a tokenizer


def place(medium, group) -> str:
    """``GPU``, ``CPU/group 1``, ``?`` (a sender that does not say)."""
    return (medium or "?") + ("" if group is None else f"/group {group}")


def preview(tokens: tuple[int, ...] | None, tokenizer=None, width: int = 40) -> str:
    """The first tokens of a prefix: decoded text with a tokenizer, else the ids."""
    if tokens is None:
        return "(tokens unknown)"
    if tokenizer is not None:
        text = tokenizer.decode(list(tokens[: 4 * width])).replace("\n", "\\n")
        return repr(text if len(text) <= width else text[: width - 2] + "..")
    ids = " ".join(map(str, tokens[:PREVIEW_TOKENS]))
    return f"[{ids}{' ..' if len(tokens) > PREVIEW_TOKENS else ''}]"


@dataclass
class PrefixRow:
    """A branch point: the prefix ending at ``block`` (``depth + 1`` blocks), which ``leaves``
    cached continuations share, ``children`` of them diverging right after it."""

    block: StoredBlock
    depth: int
    leaves: int
    children: int
    tokens_from_root: tuple[int, ...] | None = None  # the prefix's first tokens (for a preview)

    @property
    def tokens(self) -> int:
        return (self.depth + 1) * self.block.block_size


@dataclass
class CacheSummary:
    blocks: int
    per_place: dict[str, int]
    block_sizes: dict[int, int]
    roots: int
    parent_unseen: int  # roots whose parent is not held
    deepest: int  # blocks in the longest cached prefix
    longest_shared: PrefixRow | None  # the deepest prefix that >= 2 continuations share
    widest: PrefixRow | None  # the branch point with the most children
    top: list[PrefixRow]  # branch points, most continuations first
    received: dict[str, int]
    problems: dict[str, int]
    notes: list[str] = field(default_factory=list)
    capped: str | None = None
    span_s: float = 0.0
    last_seq: int | None = None

    @property
    def tokens(self) -> int:
        return sum(size * n for size, n in self.block_sizes.items())

    def lines(self, tokenizer=None, hashes_note: bool = True) -> list[str]:
        """The summary as terminal lines (a tokenizer decodes the prefixes' first tokens)."""
        r = self.received
        seq = f", last seq {self.last_seq}" if self.last_seq is not None else ""
        kinds = ", ".join(f"{r.get(k, 0)} {k}" for k in ("BlockStored", "BlockRemoved",
                                                          "AllBlocksCleared"))  # fmt: skip
        out = [f"applied {r.get('batches', 0)} batches{seq} over {self.span_s:.1f} s: "
               f"{r.get('events', 0)} events ({kinds})"]  # fmt: skip
        where = "  ".join(f"{k}: {n}" for k, n in self.per_place.items()) or "empty"
        out.append(f"cached now: {self.blocks} blocks ({self.tokens} tokens)  {where}")
        shared = self.longest_shared
        out.append(
            f"tree: {self.roots} roots ({self.parent_unseen} with parent unseen), deepest "
            f"{self.deepest} blocks, longest shared prefix "
            + (f"{shared.depth + 1} blocks ({shared.tokens} tokens)" if shared else "none")
            + (f", widest branch {self.widest.children} ways" if self.widest else "")
        )
        if self.top:
            out.append("top shared prefixes (continuations sharing it, length, hash, its start):")
        for row in self.top:
            start = preview(row.tokens_from_root, tokenizer)
            length = f"{row.depth + 1:>4} blocks"
            out.append(f"  {row.leaves:>5} x {length}  {short(row.block.key.block_hash)}  {start}")
        if self.problems:
            out.append("problems: " + ", ".join(f"{k} {n}" for k, n in self.problems.items()))
            out += [f"  {note}" for note in self.notes[-3:]]
        if self.capped:
            out.append(f"WARNING: {self.capped}")
        if hashes_note:
            out.append(f"note on {UNKNOWABLE}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def summarize(state: KVCacheState, top: int = 5) -> CacheSummary:
    leaves = state.leaves_below()
    rows, deepest = [], 0
    for block, depth in state.walk():
        deepest = max(deepest, depth + 1)
        if len(block.children) >= 2:
            rows.append(PrefixRow(block, depth, leaves[block.key], len(block.children)))
    for row in rows:  # the prefix's first tokens, for its preview
        path, block = [], row.block
        while block is not None:
            path.append(block)
            block = state.blocks[block.parent] if block.parent is not None else None
        if all(b.token_ids is not None for b in path):
            row.tokens_from_root = sum((b.token_ids for b in reversed(path[-16:])), ())
    per_place = {place(m, g): n for (m, g), n in sorted(state.counts.items(), key=str)}
    span = (state.last_ts - state.first_ts) if state.first_ts is not None else 0.0
    return CacheSummary(
        blocks=len(state.blocks),
        per_place=per_place,
        block_sizes=dict(state.block_sizes),
        roots=sum(1 for b in state.blocks.values() if b.parent is None),
        parent_unseen=sum(1 for b in state.blocks.values() if b.parent_unseen),
        deepest=deepest,
        longest_shared=max(rows, key=lambda r: (r.depth, r.leaves), default=None),
        widest=max(rows, key=lambda r: (r.children, r.depth), default=None),
        top=sorted(rows, key=lambda r: (-r.leaves, -r.depth))[:top],
        received=dict(state.received),
        problems=dict(state.problems),
        notes=list(state.notes),
        capped=state.cap_message() if state.capped else None,
        span_s=span,
        last_seq=state.last_seq,
    )


# --- a new prompt ---------------------------------------------------------------------------------
@dataclass
class HitReport:
    """How many leading full blocks of a prompt are cached now (see the module docstring)."""

    prompt_tokens: int
    block_size: int
    by_tokens: int  # leading blocks found by walking the tree with the prompt's tokens
    by_hash: int | None  # leading blocks whose computed hash is cached (None: no hasher)
    hasher: str | None = None
    keyed_skipped: int = 0  # blocks with matching tokens but LoRA / extra keys

    @property
    def full_blocks(self) -> int:
        return self.prompt_tokens // self.block_size

    @property
    def reusable(self) -> int:
        """Blocks a server would reuse: the best match, capped so the last token is computed."""
        best = max(self.by_tokens, self.by_hash or 0)
        return min(best, max(self.prompt_tokens - 1, 0) // self.block_size)

    def lines(self) -> list[str]:
        out = [f"prompt: {self.prompt_tokens} tokens = {self.full_blocks} full blocks of "
               f"{self.block_size}; cached now: {self.by_tokens} by tokens"]  # fmt: skip
        if self.by_hash is not None:
            out[0] += f", {self.by_hash} by hash ({self.hasher})"
            if self.by_hash < self.by_tokens:
                out.append("  fewer by hash than by tokens: the algorithm, the root seed or the "
                           "extra keys are not the server's")  # fmt: skip
        if self.keyed_skipped:
            out.append(f"  {self.keyed_skipped} blocks with the same tokens carry LoRA / extra "
                       "keys: not shared with this prompt")  # fmt: skip
        saved = self.reusable * self.block_size
        out.append(f"  -> {self.reusable} blocks ({saved} tokens) reusable, "
                   f"{self.prompt_tokens - saved} to compute")  # fmt: skip
        return out


_ANY = object()


def _here(key: BlockKey, rank, medium, group) -> bool:
    return all(want is _ANY or want == got for want, got in
               ((rank, key.rank), (medium, key.medium), (group, key.group)))  # fmt: skip


def hit_opportunities(state, token_ids, hasher=None, *, rank=_ANY, medium=_ANY, group=_ANY):
    tokens = list(token_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise KVEventsError("token_ids must be ints (a tokenizer's ids, not text)")
    size = getattr(hasher, "block_size", None) or state.block_size
    if not size:
        raise KVEventsError("no block is cached yet, so the block size is unknown: pass a hasher")
    level = [b for b in state.blocks.values() if b.parent_hash is None]
    by_tokens = skipped = 0
    for j in range(len(tokens) // size):
        want = tuple(tokens[j * size : (j + 1) * size])
        same = [b for b in level if b.token_ids == want and _here(b.key, rank, medium, group)]
        plain = [b for b in same if b.lora is None and b.extra_keys is None]
        skipped += len(same) - len(plain)
        if not plain:
            break
        by_tokens = j + 1
        level = [state.blocks[c] for b in plain for c in b.children]
    by_hash = None
    if hasher is not None:
        by_hash = 0
        for h in hasher(tokens):
            if not any(_here(k, rank, medium, group) for k in state.by_hash.get(h, ())):
                break
            by_hash += 1
    describe = getattr(hasher, "describe", None)
    return HitReport(len(tokens), size, by_tokens, by_hash,
                     describe() if describe else None, skipped)  # fmt: skip
