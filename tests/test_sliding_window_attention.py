"""Sliding-window attention (``sliding_window=W``: the query at position p sees the keys at
p - W < key_pos <= p) in every reference and kernel, against an independent masked softmax.

Whenever a window is given, the blocks wholly before the first key that any query of the call
sees are *freed* the way the KV-cache manager frees them: their table entries are set to -1 and
the blocks themselves filled with NaN. Reading one (even to mask it afterwards) would then give
NaN or an error, so each comparison also proves those blocks are never read. The Triton kernels
run in the CPU interpreter without a GPU (``conftest.py``), so the shapes stay small.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_cases import DEVICE, INTERPRETED, assert_close, make_case, make_queries

import kernels
from kernels import paged_attention_decode, paged_attention_prefill
from pagedlearn.attention import (
    contiguous_attention,
    paged_attention_batched,
    paged_attention_online_softmax_ref,
    paged_attention_prefill_ref,
    paged_attention_ref,
)
from pagedlearn.errors import AttentionInputError

needs_triton = pytest.mark.skipif(
    not kernels.triton_available(), reason="needs Triton, which installs on Linux only"
)
LENS = [1, 7, 16, 17, 40, 100, 0]  # a block minus/plus one, long, and a sequence with no keys


# --- the independent reference ------------------------------------------------------------------
def windowed_softmax(q, k, v, q_pos, window):
    """softmax(q kᵀ / sqrt(d)) v with an explicit mask key_pos in (q_pos - W, q_pos].

    q: (Q, H, D); k, v: (N, KVH, D) contiguous, positions 0..N-1; q_pos: list of Q positions.
    Written with einsum over repeated KV heads: no code shared with pagedlearn.attention.
    """
    num_q, num_heads, head_dim = q.shape
    if k.shape[0] == 0:
        return torch.zeros(num_q, num_heads, head_dim, dtype=torch.float64)
    group = num_heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # (N, H, D)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,nhd->hqn", q.double(), kk) / head_dim**0.5
    key_pos = torch.arange(k.shape[0])[None, :]
    pos = torch.tensor(q_pos)[:, None]
    mask = key_pos <= pos
    if window is not None:
        mask &= key_pos > pos - window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqn,nhd->qhd", torch.softmax(scores, dim=-1), vv)


def expected_decode(case, q, window):
    rows = []
    for i, n in enumerate(case.context_lens.tolist()):
        k, v = case.keys[i].cpu(), case.values[i].cpu()
        rows.append(windowed_softmax(q[i : i + 1].cpu(), k, v, [n - 1], window)[0])
    return torch.stack(rows).to(q.dtype)


def freed(case, first_blocks):
    """(key_cache, value_cache, block_tables) with sequence i's blocks before first_blocks[i]
    freed: NaN inside, -1 in the table (each physical block belongs to one sequence here)."""
    kc, vc, tables = case.key_cache.clone(), case.value_cache.clone(), case.block_tables.clone()
    for i, first in enumerate(first_blocks):
        ids = tables[i, :first].long()
        kc[ids], vc[ids] = float("nan"), float("nan")
        tables[i, :first] = -1
    return kc, vc, tables


def decode_inputs(lens, block_size, heads, kv_heads, window, head_dim=16, seed=0):
    case = make_case(lens, block_size, kv_heads, head_dim, seed=seed)
    q = make_queries(len(lens), heads, head_dim, seed=seed + 1)
    firsts = [0 if window is None else max(0, n - window) // block_size for n in lens]
    kc, vc, tables = freed(case, firsts)
    return case, (q, kc, vc, tables, case.context_lens), firsts


# --- decode: the references ------------------------------------------------------------------
WINDOWS = [1, 5, 16, 17, 40, 41, 100, 1000]  # < = > the contexts; multiples of 16 and not


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2)])  # MHA, GQA (4 per KV head)
def test_decode_references_match_the_independent_softmax(block_size, heads, kv_heads):
    for window in WINDOWS:
        case, args, firsts = decode_inputs(LENS, block_size, heads, kv_heads, window)
        assert window > 40 or any(firsts), "the test frees some blocks"
        want = expected_decode(case, args[0], window)
        outs = {
            "paged_attention_ref": paged_attention_ref(*args, sliding_window=window),
            "batched": paged_attention_batched(*args, sliding_window=window),
            **{
                f"online, {s} splits": paged_attention_online_softmax_ref(
                    *args, num_splits=s, sliding_window=window
                )
                for s in (1, 3, 64)
            },
        }
        for name, out in outs.items():
            assert not out.isnan().any(), (name, window)
            assert_close(out, want)
        assert not outs["batched"][-1].any()  # no keys: zeros


def test_contiguous_attention_window_against_the_independent_softmax():
    k, v = torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    q = make_queries(12, 4, 16).cpu()  # the last 12 of 30 positions
    for window in (1, 4, 12, 13, 30, 31):
        got = contiguous_attention(q, k, v, sliding_window=window)
        assert_close(got, windowed_softmax(q, k, v, list(range(18, 30)), window).float())
    with pytest.raises(AttentionInputError, match="needs causal=True"):
        contiguous_attention(q, k, v, causal=False, sliding_window=4)


def test_no_window_is_unchanged_and_equals_a_window_longer_than_every_context():
    case, args, _ = decode_inputs(LENS, 3, 8, 2, None)
    for fn in (paged_attention_ref, paged_attention_batched, paged_attention_online_softmax_ref):
        plain = fn(*args)  # the call as it was before windows existed
        assert torch.equal(fn(*args, sliding_window=None), plain)
        assert torch.equal(fn(*args, sliding_window=max(LENS)), plain)  # bit for bit
        assert_close(plain, expected_decode(case, args[0], None))


# --- decode: the Triton kernel -------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_the_independent_softmax(block_size, num_splits):
    for window in (1, 5, 16, 17, 41, 1000):
        case, args, _ = decode_inputs(LENS, block_size, 8, 2, window, seed=block_size)
        out = paged_attention_decode(*args, num_splits=num_splits, sliding_window=window)
        assert not out.isnan().any(), window
        assert_close(out, expected_decode(case, args[0], window))


@needs_triton
def test_decode_kernel_without_a_window_is_unchanged():
    case, args, _ = decode_inputs(LENS, 16, 8, 2, None)
    for splits in (1, 4):
        plain = paged_attention_decode(*args, num_splits=splits)
        assert torch.equal(
            paged_attention_decode(*args, num_splits=splits, sliding_window=1000), plain
        )
        assert_close(plain, expected_decode(case, args[0], None))


@needs_triton
@pytest.mark.skipif(not INTERPRETED, reason="loads are counted in Triton's CPU interpreter")
def test_decode_kernel_loads_only_the_windows_blocks():
    from kernels.count_loads import decode_loads, expected_blocks

    case, args, firsts = decode_inputs([200], 16, 4, 1, 40)
    table = case.block_tables[0].tolist()
    for splits in (1, 3):  # keys 160..199: blocks 10, 11, 12
        out, loads = decode_loads(*args, splits, sliding_window=40)
        assert firsts == [10] and expected_blocks(200, 16, 40) == 3
        assert loads.key_blocks == loads.value_blocks == set(table[10:13])
        assert loads.table_entries == {10, 11, 12} and loads.key_slots == 40
        assert_close(out, expected_decode(case, args[0], 40))
    _, args, _ = decode_inputs([200], 16, 4, 1, None)
    _, loads = decode_loads(*args, sliding_window=None)
    assert loads.key_blocks == set(table[:13]) and loads.key_slots == 200


# --- prefill: the reference and the kernel -------------------------------------------------------
# (cached prefix, new queries): a one-token prompt, a prompt, a prefix-cache hit, a chunk of a
# long prompt (more queries than the kernel's BLOCK_M = 32 rows), a decode step, a chunk after one
SEQUENCES = [(0, 1), (0, 20), (35, 5), (60, 70), (99, 1), (32, 33)]


def prefill_inputs(sequences, block_size, heads, kv_heads, window, head_dim=16, seed=0):
    lens = [p + n for p, n in sequences]
    case = make_case(lens, block_size, kv_heads, head_dim, seed=seed)
    q_lens = [n for _, n in sequences]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = make_queries(sum(q_lens), heads, head_dim, seed=seed + 1)
    first_pos = [p for p, _ in sequences]  # each sequence's earliest query
    firsts = [0 if window is None else max(0, p - window + 1) // block_size for p in first_pos]
    kc, vc, tables = freed(case, firsts)
    want = []
    for i, (p, n) in enumerate(sequences):
        k, v = case.keys[i].cpu(), case.values[i].cpu()
        rows = q[cu[i] : cu[i + 1]].cpu()
        want.append(windowed_softmax(rows, k, v, list(range(p, p + n)), window))
    args = (q, kc, vc, tables, cu.to(DEVICE), case.context_lens)
    return args, torch.cat(want).float(), firsts


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_prefill_reference_matches_the_independent_softmax(block_size):
    for window in (None, *WINDOWS):
        args, want, _ = prefill_inputs(SEQUENCES, block_size, 8, 2, window)
        out = paged_attention_prefill_ref(*args, sliding_window=window)
        assert_close(out, want)


@needs_triton
@pytest.mark.parametrize(
    ("block_size", "window"), [(1, 5), (3, 17), (16, 1), (16, 40), (16, 1000), (3, None)]
)
def test_prefill_kernel_matches_the_independent_softmax(block_size, window):
    args, want, firsts = prefill_inputs(SEQUENCES, block_size, 4, 1, window)
    assert window in (None, 1000) or any(firsts)
    out = paged_attention_prefill(*args, sliding_window=window)
    assert not out.isnan().any()
    assert_close(out, want)


@needs_triton
def test_prefill_kernel_rows_whose_first_key_tiles_are_all_masked_stay_finite():
    """With TILE_N < BLOCK_M, a query tile's later rows see none of the first key tile (it
    starts at the earliest row's window): their running max stays -inf through it."""
    from kernels.prefix_prefill import BLOCK_M, launch_constants
    from pagedlearn.attention.inputs import check_prefill

    args, want, _ = prefill_inputs([(3, 40)], 16, 2, 1, 4, head_dim=256)
    shape = check_prefill(*args, None, False)
    assert launch_constants(shape, torch.float32, INTERPRETED)["TILE_N"] < BLOCK_M
    out = paged_attention_prefill(*args, sliding_window=4)
    assert not out.isnan().any()
    assert_close(out, want)


# --- bad windows, and the table checks under a window ----------------------------------------
def _all_functions():
    _, args, _ = decode_inputs([5, 9], 4, 4, 2, None)
    pargs, _, _ = prefill_inputs([(3, 2)], 4, 4, 2, None)
    k = torch.randn(5, 2, 16)
    calls = {
        "contiguous_attention": lambda w: contiguous_attention(args[0][:1], k, k, sliding_window=w),
        "paged_attention_ref": lambda w: paged_attention_ref(*args, sliding_window=w),
        "online": lambda w: paged_attention_online_softmax_ref(*args, sliding_window=w),
        "batched": lambda w: paged_attention_batched(*args, sliding_window=w),
        "prefill_ref": lambda w: paged_attention_prefill_ref(*pargs, sliding_window=w),
    }
    if kernels.triton_available():
        calls["decode"] = lambda w: paged_attention_decode(*args, sliding_window=w)
        calls["prefill"] = lambda w: paged_attention_prefill(*pargs, sliding_window=w)
    return calls


@pytest.mark.parametrize("window", [0, -1, 2.5, True, "4", torch.tensor(4)])
def test_bad_windows_are_refused_by_every_function(window):
    for name, call in _all_functions().items():
        with pytest.raises(AttentionInputError, match="sliding_window must be an int >= 1") as e:
            call(window)
        assert isinstance(e.value, ValueError), name


def test_table_checks_accept_anything_before_the_window_and_refuse_bad_ids_inside_it():
    if DEVICE != "cpu":
        pytest.skip("the kernels check table values on CPU tensors only")
    _, (q, kc, vc, tables, lens), _ = decode_inputs([40], 4, 4, 2, None)
    tables[0, :7] = torch.tensor([-1, 999, -5, 10**6, -1, -1, -1])  # keys 0..27: all before
    fns = [paged_attention_ref, paged_attention_online_softmax_ref, paged_attention_batched]
    if kernels.triton_available():
        fns.append(paged_attention_decode)
    for fn in fns:
        fn(q, kc, vc, tables, lens, sliding_window=12)  # sees keys 28..39: blocks 7, 8, 9
        with pytest.raises(AttentionInputError, match=r"block_tables\[0\] uses block -1"):
            fn(q, kc, vc, tables, lens, sliding_window=13)  # key 27 is in block 6
        with pytest.raises(AttentionInputError, match="uses block -1"):
            fn(q, kc, vc, tables, lens)  # no window: every block is read


def test_prefill_table_checks_look_at_the_earliest_query_of_each_sequence():
    if DEVICE != "cpu":
        pytest.skip("the kernels check table values on CPU tensors only")
    # 40 keys, the last 8 are queries (positions 32..39). With W = 5 the earliest sees 28..32.
    args, _, firsts = prefill_inputs([(32, 8)], 4, 4, 2, 5)
    assert firsts == [7]  # blocks 0..6 freed (keys 0..27)
    fns = [paged_attention_prefill_ref]
    if kernels.triton_available():
        fns.append(paged_attention_prefill)
    for fn in fns:
        fn(*args, sliding_window=5)
        with pytest.raises(
            AttentionInputError,
            match=r"uses block -1, .*logical block 6: the call reads logical blocks 6 to 9",
        ):
            fn(*args, sliding_window=6)  # the earliest query now needs key 27, in block 6


@needs_triton
def test_the_benchmark_counts_the_blocks_in_the_interpreter():
    """benchmarks/bench_sliding_window.py keeps working (small here: 1,000 tokens, W = 100)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_sliding_window.py", "--context", "1000", "--window",
         "100"],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = re.findall(r"^ +(none|\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) +(\d+) ", out.stdout, re.M)
    # (window, splits, K blocks, V blocks, table entries, tokens, expected blocks)
    got = [(w, int(k), int(v), int(t), int(n), int(e)) for w, _, k, v, t, n, e in rows]
    assert got == [("none", 63, 63, 63, 1000, 63)] * 2 + [("100", 7, 7, 7, 100, 7)] * 2, got
    assert "window / none: blocks 7 / 63" in out.stdout
