"""Lab 4 · Paged attention in PyTorch: read K/V through a block table, then softmax block by block.

You write three functions of :mod:`pagedlearn.attention`, the references chapter 05
(``05_paged_attention_kernel``) builds the Triton kernel from:

- ``gather`` -- :func:`~pagedlearn.attention.gather_kv`: one sequence's K/V made contiguous
  through its block table (logical block ``j`` is physical block ``block_table[j]``; the last
  block may be partly filled); and :func:`~pagedlearn.attention.paged_attention_ref`, decode
  attention over the paged cache as "gather, then attend";
- ``write`` -- :func:`~pagedlearn.attention.write_kv_ref`: the KV write, token ``i`` to slot
  ``slot_mapping[i]``, padding (negative slots) skipped, bad input refused before any write;
- ``online`` -- :func:`~pagedlearn.attention.paged_attention_online_softmax_ref`: attention one
  block at a time with a running max, sum and accumulator (the loop of the kernel), and with
  ``num_splits > 1`` slices merged by their log-sum-exp (flash-decoding).

What the checks look at. Every output is compared with the package's own
:func:`~pagedlearn.attention.paged_attention_ref` (or the contiguous K/V the test scattered) on
small random float32 inputs, made to expose mistakes: physical blocks handed out shuffled, slots
no token was written to hold NaN (reading one poisons the result), partly filled last blocks,
grouped-query heads, empty contexts, scores large enough that ``exp`` overflows without the
running max, and more splits than blocks. A failure names the sequence (its context length,
block size and blocks), the error, and, when your output equals a known wrong answer (blocks
read in physical order, the last block skipped or read in full, the wrong KV head), that mistake.
"""

from __future__ import annotations

import torch

from pagedlearn import attention as ref
from pagedlearn.errors import AttentionInputError
from pagedlearn.labs.attention_cases import Case, compare, make_case, run
from pagedlearn.labs.lab import CheckFailed, Exercise, Lab, explore

LAB = Lab(
    id="attention",
    number=4,
    title="Paged attention in PyTorch: gather, write, online softmax",
    chapter="05_paged_attention_kernel",
    files=("pagedlearn/attention/references.py",),
    exercises=(
        Exercise(
            "gather",
            "Paged attention = gather, then attend",
            {
                "gather_kv": "return (k, v), each (context_len, num_kv_heads, head_dim): the "
                "physical blocks block_table names for the ceil(context_len / block_size) "
                "logical blocks, in table order, concatenated, cut to context_len tokens",
                "paged_attention_ref": "check the input (shape = check_decode(..., True)); "
                "for each sequence i, gather its K/V and attend with contiguous_attention("
                "q[i : i + 1], k, v, shape.scale); return (num_seqs, num_heads, head_dim)",
            },
        ),
        Exercise(
            "write",
            "Write K/V at their slots",
            {
                "write_kv_ref": "check the input first (shape = check_write_kv(...)), then write "
                "token i's key and value in place at block slot // block_size, row slot % "
                "block_size of the caches; skip tokens whose slot is negative",
            },
        ),
        Exercise(
            "online",
            "The online softmax, block by block, with splits",
            {
                "paged_attention_online_softmax_ref": "check the input (shape = check_decode(..., "
                "True); ValueError unless num_splits is an int >= 1); per sequence, walk its "
                "blocks keeping per head a running max m, sum l of exp(score - m) and acc of "
                "exp(score - m) * v, rescaled by exp(m_old - m_new); divide acc / l once; with "
                "num_splits > 1 merge the slices weighting each by exp(m_s - max m); no keys: 0",
            },
        ),
    ),
)


# --- gather ------------------------------------------------------------------------------------
def _check_gather(sub, case: Case) -> None:
    kc, vc, bs = case.key_cache, case.value_cache, case.block_size
    for i, n in enumerate(case.lens):
        where = f"sequence {i} ({case.describe(i)}): gather_kv(..., block_tables[{i}], {n})"
        got = run(where, sub.gather_kv, kc, vc, case.block_tables[i], n)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"{where} should return a pair (k, v); yours returned {got!r:.60}")
        for name, t, truth in (("k", got[0], case.keys[i]), ("v", got[1], case.values[i])):
            if not isinstance(t, torch.Tensor) or t.shape != truth.shape:
                nb = -(-n // bs)
                raise CheckFailed(
                    f"{where}: {name} should have shape {tuple(truth.shape)} (ceil({n} / {bs}) = "
                    f"{nb} blocks, cut to the first {n} tokens); yours has "
                    f"{tuple(getattr(t, 'shape', ()))}"
                )
            wrong = [p for p in range(n) if not torch.equal(t[p], truth[p])]
            if wrong:
                p, blocks = wrong[0], case.blocks(i)
                j, off = divmod(p, bs)
                first = (kc if name == "k" else vc)[: len(blocks)].flatten(0, 1)[:n]
                hint = ""
                if torch.equal(t.nan_to_num(7.0), first.nan_to_num(7.0)):
                    hint = f": yours reads the blocks in physical order 0, 1, ..., not {blocks}"
                elif t[p].isnan().any():
                    hint = ": yours holds NaN there, from a slot no token was written to"
                raise CheckFailed(
                    f"{where}: token {p} should be {name}_cache[{blocks[j]}, {off}] (logical block"
                    f" {j} = {p} // {bs} is physical block {blocks[j]}, offset {p} % {bs}); "
                    f"yours differs{hint}"
                )


@LAB.check("gather", points=2)
def gather_follows_the_block_table(sub):
    _check_gather(sub, make_case([5, 8, 1, 13], 4, seed=1))
    _check_gather(sub, make_case([7, 3], 1, seed=2))
    _check_gather(sub, make_case([7, 3], 3, seed=3))
    _check_gather(sub, make_case([0, 4], 4, seed=4))  # no tokens: (0, num_kv_heads, head_dim)


@LAB.check("gather", points=2)
def paged_attention_ref_is_gather_then_attend(sub):
    for case, scale in (
        (make_case([5, 8, 0], 4, seed=30), None),
        (make_case([6, 9], 2, heads=4, kv_heads=2, seed=31), 0.5),
    ):
        where = f"paged_attention_ref(scale={scale}) on {case.setting()}"
        out = run(where, sub.paged_attention_ref, *case.args(), scale)
        hint = "pass shape.scale on (check_decode(...) turns scale=None into 1 / sqrt(head_dim))"
        compare(where, out, ref.paged_attention_ref(*case.args(), scale), case, hint)
    for _, kind, why, case in _bad_inputs()[1:]:
        refuses("paged_attention_ref", sub.paged_attention_ref, case, None, kind, why)


def _bad_inputs() -> list:
    """``(num_splits, error, what is wrong, case)``: inputs the functions must refuse."""
    ok, narrow, bad_id = (make_case([5], 4, seed=16) for _ in range(3))
    narrow.q = narrow.q[:, :, :4]
    bad_id.block_tables[0, 1] = bad_id.key_cache.shape[0]
    return [
        (0, ValueError, "num_splits=0", ok),
        (1, AttentionInputError, "q's head_dim 4, the cache's 8", narrow),
        (1, AttentionInputError, "a block table that names a block past the cache", bad_id),
    ]


def refuses(call: str, fn, case: Case, num_splits, kind, why: str) -> None:
    """CheckFailed unless ``fn`` on ``case`` raises ``kind``."""
    try:
        fn(*case.args(), **({} if num_splits is None else {"num_splits": num_splits}))
        got = "returned normally"
    except kind:
        return
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        got = f"raised {type(e).__name__}: {e}"
    raise CheckFailed(
        f"{call} with {why} should raise {kind.__name__} (check_decode(..., True) checks the "
        f"tensors and the tables' values; num_splits is yours to check); yours {got}"
    )


# --- write -------------------------------------------------------------------------------------
def _check_write(sub, slots: list[int]) -> None:
    torch.manual_seed(5)
    bs, n = 4, len(slots)
    caches = [torch.zeros(4, bs, 2, 8) for _ in range(4)]  # yours k, v; the reference's k, v
    key, value = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    mapping = torch.tensor(slots)
    text = f"write_kv_ref(key, value, key_cache, value_cache, slot_mapping={slots})"
    run(text, sub.write_kv_ref, key, value, caches[0], caches[1], mapping)
    ref.write_kv_ref(key, value, caches[2], caches[3], mapping)
    where = f"{text} with block_size {bs}"
    for name, yours, want, rows in (("key", *caches[::2], key), ("value", *caches[1::2], value)):
        for i, s in enumerate(slots):
            b, r = divmod(s, bs)
            if s >= 0 and not torch.equal(yours[b, r], rows[i]):
                flat = yours.flatten(0, 1)
                at = [
                    list(divmod(j, bs)) for j in range(len(flat)) if torch.equal(flat[j], rows[i])
                ]
                found = f"yours wrote it at {name}_cache{at[0]}" if at else "it is not in yours"
                if not yours.any():
                    found += f" ({name}_cache is unchanged: write into it, in place)"
                raise CheckFailed(
                    f"{where}: token {i}'s {name} (slot {s} = block {s} // {bs} = {b}, row {s} % "
                    f"{bs} = {r}) should be at {name}_cache[{b}, {r}]; {found}"
                )
        extra = (yours != want).any(dim=(-1, -2)).nonzero().tolist()
        if extra:
            skipped = [i for i, s in enumerate(slots) if s < 0]
            why = (
                f"; tokens {skipped} have slot -1, padding: write nothing for them"
                if skipped
                else ""
            )
            raise CheckFailed(
                f"{where}: yours also changed {name}_cache{extra[0]}, no token's slot{why}"
            )


@LAB.check("write", points=2)
def write_puts_each_token_at_its_slot(sub):
    _check_write(sub, [6, 1, 12, 3, 15])
    _check_write(sub, [9])


@LAB.check("write", points=1)
def write_skips_negative_slots(sub):
    _check_write(sub, [-1, 5, -1, 0])
    _check_write(sub, [-1])


@LAB.check("write", points=1)
def write_refuses_bad_slots_and_writes_nothing(sub):
    torch.manual_seed(6)
    bad = (([1, 16], "slot 16 is past the cache's 16 slots"), ([3, 3], "two tokens in slot 3"))
    for slots, why in bad:
        caches = (torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))
        key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
        text = f"write_kv_ref(key, value, key_cache, value_cache, slot_mapping={slots})"
        try:
            sub.write_kv_ref(key, value, *caches, torch.tensor(slots))
            got = "returned normally"
        except AttentionInputError:
            got = None
        except (CheckFailed, NotImplementedError):
            raise
        except Exception as e:
            got = f"raised {type(e).__name__}: {e}"
        if got is None and any(c.any() for c in caches):
            got = "raised it, but after writing to the cache"
        if got is not None:
            raise CheckFailed(
                f"{text} with a cache of 4 blocks of 4 ({why}) should raise AttentionInputError "
                f"before writing anything (check_write_kv(...) does it); yours {got}"
            )


# --- the online softmax ------------------------------------------------------------------------
def check_online(sub, case: Case, num_splits: int = 1, hint: str = "") -> None:
    where = f"paged_attention_online_softmax_ref(num_splits={num_splits}) on {case.setting()}"
    fn = sub.paged_attention_online_softmax_ref
    out = run(where, fn, *case.args(), scale=None, num_splits=num_splits)
    compare(where, out, ref.paged_attention_ref(*case.args()), case, hint)


@LAB.check("online", points=1)
def online_one_full_block(sub):
    hint = (
        "with one full block there is no masking and no rescaling: check the scores "
        "(q . k * scale), exp(score - m) and the one division acc / l"
    )
    check_online(sub, make_case([4], 4, seed=7), hint=hint)


@LAB.check("online", points=2)
def online_partial_last_block(sub):
    hint = "the last block holds context_len - (blocks - 1) * block_size tokens; only those count"
    check_online(sub, make_case([5, 8, 3, 11], 4, seed=8), hint=hint)


@LAB.check("online", points=1)
def online_grouped_query_heads(sub):
    hint = "query head h reads KV head h // (num_heads // num_kv_heads)"
    check_online(sub, make_case([6, 9], 4, heads=4, kv_heads=2, seed=9), hint=hint)
    check_online(sub, make_case([6], 2, heads=4, kv_heads=1, seed=10), hint=hint)


@LAB.check("online", points=1)
def online_empty_context_is_zeros(sub):
    hint = "a sequence with no keys gets zeros: l stays 0, so do not divide by it"
    for splits in (1, 3):
        check_online(sub, make_case([0, 3], 4, seed=11), splits, hint)


def _rising(i, t, n):
    return -8 + 16 * t / max(n - 1, 1)


@LAB.check("online", points=2)
def online_rescales_when_the_max_grows(sub):
    hint = (
        "here the scores grow from block to block: when the max grows, what was summed under "
        "the old max (l and acc) must be multiplied by exp(m_old - m_new); divide acc by l "
        "once, after the last block"
    )
    check_online(sub, make_case([12, 17], 4, seed=12, ramp=_rising), hint=hint)


def _steep(i, t, n):  # sequence 0 rises from -150 to 150, sequence 1 falls from 150 to -150
    return (-150 + 300 * t / max(n - 1, 1)) * (1 if i % 2 == 0 else -1)


@LAB.check("online", points=2)
def online_large_scores_stay_finite(sub):
    hint = (
        "scores here reach +-150, and exp overflows float32 past 88: take exp(score - m) with "
        "m the running max, and rescale l and acc by exp(m_old - m_new) <= 1"
    )
    check_online(sub, make_case([8, 12], 4, seed=13, ramp=_steep), hint=hint)


@LAB.check("online", points=2)
def online_splits_equal_one_pass(sub):
    hint = (
        "with num_splits > 1 the blocks are cut into slices of ceil(blocks / num_splits), each "
        "with its own (m, l, acc); the merge weights slice s by w_s = exp(m_s - max m): "
        "out = sum w_s acc_s / sum w_s l_s"
    )
    for splits in (2, 3):
        check_online(sub, make_case([7, 16, 23], 4, seed=14), splits, hint)


@LAB.check("online", points=1)
def online_more_splits_than_blocks(sub):
    hint = (
        "a slice with no blocks keeps m = -inf and l = 0: its weight exp(m_s - max m) is 0; "
        "no NaN may come from it (exp(-inf - -inf))"
    )
    check_online(sub, make_case([5, 9], 4, seed=15), 5, hint)


@LAB.check("online", points=2, timeout_s=30.0)
def online_random_cases(sub):
    from hypothesis import strategies as st

    cases = st.tuples(
        st.lists(st.integers(0, 13), min_size=1, max_size=3),
        st.sampled_from([1, 2, 3, 4]),
        st.sampled_from([(1, 1), (2, 1), (4, 2)]),
        st.integers(1, 4),
    )

    def one(example):
        lens, bs, (heads, kv_heads), splits = example
        check_online(sub, make_case(lens, bs, heads, kv_heads), splits)

    explore(cases, one, max_examples=60)


@LAB.check("online", points=1)
def online_refuses_bad_input(sub):
    fn = sub.paged_attention_online_softmax_ref
    for splits, kind, why, case in _bad_inputs():
        refuses(
            f"paged_attention_online_softmax_ref(num_splits={splits})", fn, case, splits, kind, why
        )
