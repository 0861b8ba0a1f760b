"""Test inputs for the ``attention`` and ``kernel`` labs, and how an output is judged.

:func:`make_case` builds a paged KV cache the way that makes attention mistakes loud: physical
blocks handed out shuffled (a loop that ignores the block table reads someone else's K/V), NaN in
every slot no token was written to (a read past a sequence's end poisons the result instead of
nudging it), table rows longer than needed whose extra entries are not blocks of the cache (a
loop that reads past a sequence's blocks fails), spare room at the end of the cache, and, on
request, scores that follow a ramp (a max that grows or falls from block to block, or scores
past ``exp``'s float32 range).

:func:`compare` judges an output against :func:`~pagedlearn.attention.paged_attention_ref`: it
names the first wrong sequence (context length, block size, blocks), the error, and -- when the
output equals the answer a known mistake gives (:func:`known_mistakes`) -- that mistake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedlearn import attention as ref
from pagedlearn.labs.lab import CheckFailed, crashed


# --- test inputs: paged caches made to expose mistakes ----------------------------------------
@dataclass
class Case:
    q: torch.Tensor  # (num_seqs, num_heads, head_dim)
    key_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim); NaN if unwritten
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max(lens) + 1) int32, padded (see make_case)
    context_lens: torch.Tensor  # (num_seqs,) int32
    keys: list  # per sequence, its contiguous (context_len, num_kv_heads, head_dim) keys
    values: list

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def lens(self) -> list[int]:
        return self.context_lens.tolist()

    def args(self) -> tuple:
        return self.q, self.key_cache, self.value_cache, self.block_tables, self.context_lens

    def blocks(self, i: int) -> list[int]:
        return self.block_tables[i, : -(-self.lens[i] // self.block_size)].tolist()

    def describe(self, i: int) -> str:
        blocks = self.blocks(i)
        shown = str(blocks) if len(blocks) <= 8 else f"{str(blocks[:6])[:-1]}, ... ({len(blocks)})]"
        return f"context {self.lens[i]}, block_size {self.block_size}, blocks {shown}"

    def setting(self) -> str:
        heads, kv = self.q.shape[1], self.key_cache.shape[2]
        return (
            f"context_lens {self.lens}, block_size {self.block_size}, {heads}/{kv} heads/KV heads"
        )


def make_case(
    lens,
    block_size,
    heads=2,
    kv_heads=2,
    head_dim=8,
    seed=0,
    ramp=None,
    device="cpu",
    pad_inside=False,
) -> Case:
    """Random K/V for sequences of ``lens`` tokens over shuffled physical blocks.

    Unwritten slots hold NaN. Table rows are ``max(lens) + 1`` wide; the entries past a
    sequence's blocks may be anything (as in the engine), and here they are an id past the
    cache, so that reading one fails -- or, with ``pad_inside``, a spare block's id (all NaN),
    for a kernel, where a read out of bounds could crash the process. The cache ends with
    blocks no id names, enough that a token read up to ``max(lens)`` slots past its block's
    start stays inside it.
    ``ramp(i, t, n)``: the score of sequence ``i``'s token ``t`` (of ``n``) is about this value
    (every query points one way, every key gets ``ramp`` along it); else random.
    """
    torch.manual_seed(seed)
    bs, longest = block_size, max(lens, default=0)
    used = [-(-n // bs) for n in lens]
    num_ids = sum(used) + 2  # two spare blocks among the used ones
    shape = (num_ids + longest // bs + 1, bs, kv_heads, head_dim)
    key_cache, value_cache = torch.full(shape, math.nan), torch.full(shape, math.nan)
    order = torch.randperm(num_ids)
    pad = int(order[-1]) if pad_inside else shape[0] + 7
    tables = torch.full((len(lens), longest + 1), pad, dtype=torch.int32)
    u = torch.nn.functional.normalize(torch.randn(head_dim), dim=0)
    if ramp is None:
        q = torch.randn(len(lens), heads, head_dim)
    else:  # q . (c u) * scale = 1: key t's score is about ramp(i, t, n)
        q = 3 * u + 0.1 * torch.randn(len(lens), heads, head_dim)
        c = math.sqrt(head_dim) / 3
    keys, values, taken = [], [], 0
    for i, n in enumerate(lens):
        ids = order[taken : taken + used[i]]
        taken += used[i]
        tables[i, : used[i]] = ids
        k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
        if ramp is not None:
            k = 0.3 * k + torch.tensor([ramp(i, t, n) * c for t in range(n)])[:, None, None] * u
        for t in range(n):
            key_cache[ids[t // bs], t % bs], value_cache[ids[t // bs], t % bs] = k[t], v[t]
        keys.append(k.to(device))
        values.append(v.to(device))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    tensors = (q, key_cache, value_cache, tables, lens_t)
    return Case(*(t.to(device) for t in tensors), keys, values)


# --- comparing an output with the reference -------------------------------------------------------
# The labs' tolerance for float32 attention outputs: every comparison of a student's tensor with
# the reference's uses it (here, kernel.py, and the replayed recordings of expected.py).
ATOL, RTOL = 2e-5, 1e-4


def first_mismatch(out, want, atol=ATOL, rtol=RTOL) -> tuple[int, str] | None:
    """``(sequence, what is wrong)`` for the first sequence where ``out`` differs, or None."""
    for i in range(want.shape[0]):
        o, w = out[i].float(), want[i].float()
        if torch.allclose(o, w, atol=atol, rtol=rtol):
            continue
        if not torch.isfinite(o).all():
            what = "nan" if o.isnan().any() else "inf"
            return i, (
                f"your output has {what} where paged_attention_ref's is finite (unwritten slots "
                "hold NaN here: was one read? else look for 0 / 0, inf - inf or exp overflowing)"
            )
        return i, f"max abs error {float((o - w).abs().max()):.3g} vs paged_attention_ref"
    return None


def diagnose(out, variants) -> str:
    """The explanation of the first ``(explanation, wrong answer)`` that ``out`` equals."""
    for why, wrong in variants:
        try:
            w = wrong()
        except Exception:  # a variant that does not apply to this case
            continue
        if w is None or w.shape != out.shape or not torch.isfinite(w).any():
            continue  # (NaN everywhere would match NaN everywhere, whatever the cause)
        if torch.allclose(out, w, atol=ATOL, rtol=RTOL, equal_nan=True):
            return why
    return ""


def known_mistakes(case: Case, scale=None) -> list:
    """Wrong answers a common mistake gives on ``case``, computed with the reference."""
    q, kc, vc, tables, lens = case.args()
    bs, heads, kv_heads = case.block_size, q.shape[1], kc.shape[2]
    full = (lens + bs - 1) // bs * bs
    in_order = torch.arange(tables.shape[1], dtype=tables.dtype).expand_as(tables)
    # Query head h reading KV head h % kv_heads is the reference with head h moved to `pos[h]`.
    h = torch.arange(heads, device=q.device)
    pos = (h % kv_heads) * (heads // kv_heads) + h // kv_heads
    moved = torch.empty_like(q)
    moved[:, pos] = q

    def paged(q=q, tables=tables, lens=lens, scale=scale):
        return ref.paged_attention_ref(q, kc, vc, tables, lens.to(torch.int32), scale)

    return [
        (
            "the last, partly filled block seems to be read in full (positions past "
            "context_len must not count; here they hold NaN)",
            lambda: paged(lens=full),
        ),
        (
            f"the last, partly filled block seems to be skipped: a context of n tokens fills "
            f"ceil(n / {bs}) blocks, not n // {bs}",
            lambda: paged(lens=lens // bs * bs),
        ),
        (
            "the blocks seem to be read in physical order 0, 1, 2, ..., not through the block "
            "table (logical block j is physical block block_tables[i][j])",
            lambda: paged(tables=in_order.to(q.device)),
        ),
        (
            f"query head h seems to read KV head h % {kv_heads}; it reads h // "
            f"{heads // kv_heads} (num_heads // num_kv_heads): repeat_interleave, not repeat",
            lambda: paged(q=moved)[:, pos] if heads > kv_heads else None,
        ),
        (
            "the scores seem not to be multiplied by scale (1 / sqrt(head_dim) by default)",
            lambda: paged(scale=1.0) if scale is None else None,
        ),
    ]


def compare(where: str, out, want, case: Case, hint: str = "", mistakes=None) -> None:
    """Raise CheckFailed naming the first wrong sequence, the error, and the likely mistake."""
    if not isinstance(out, torch.Tensor):
        raise CheckFailed(f"{where}: should return a tensor; yours returned {out!r:.60}")
    if out.shape != want.shape or out.dtype != want.dtype:
        raise CheckFailed(
            f"{where}: should return {tuple(want.shape)} {want.dtype} (num_seqs, num_heads, "
            f"head_dim) in q's dtype; yours is {tuple(out.shape)} {out.dtype}"
        )
    bad = first_mismatch(out, want)
    if bad is None:
        return
    i, problem = bad
    why = diagnose(out, known_mistakes(case) if mistakes is None else mistakes) or hint
    why = f"; {why}" if why else ""
    raise CheckFailed(f"{where}: sequence {i} ({case.describe(i)}): {problem}{why}")


def run(text: str, fn, *args, **kwargs):
    """Call the student's ``fn``; an exception becomes a verdict naming the call."""
    try:
        return fn(*args, **kwargs)
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        raise crashed([text], e) from e
