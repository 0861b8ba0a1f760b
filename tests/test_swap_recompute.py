"""Figure 19's measurement (pagedlearn.sim.swap_recompute): the rows, and that what it times really
moves and writes the KV. Timings are measured, never asserted."""

import math

import pytest
import torch

from pagedlearn.models import ModelLoadError, load
from pagedlearn.models.runner import kv_cache_spec
from pagedlearn.sim.swap_recompute import (
    FIELDS,
    SPREADS,
    measure,
    plot_figure19,
    prepare,
    swap_per_block,
)


@pytest.fixture(scope="module")
def rows():
    return measure((1, 5, 64), num_tokens=70, model="tiny-gpt2", repeats=1)


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt2")


def test_rows_have_the_fields_bytes_and_block_counts(rows, tiny):
    per_token = kv_cache_spec(tiny.model).bytes_per_token  # 2 x 2 layers x 4 heads x 16 x 4 B
    assert per_token == 1024
    assert [r["block_size"] for r in rows] == [1, 5, 64]
    for r in rows:
        assert tuple(r) == FIELDS + SPREADS
        bs = r["block_size"]
        assert r["num_blocks"] == math.ceil(70 / bs)
        assert r["bytes"] == r["num_blocks"] * bs * per_token  # whole blocks: 70, 70, 128 tokens
        assert all(r[k] > 0 for k in FIELDS) and all(r[k] >= 0 for k in SPREADS)
        swap = r["swap_out_ms"] + r["swap_in_ms"]
        assert r["recompute_over_swap"] == pytest.approx(r["recompute_ms"] / swap)
    assert [r["bytes"] // per_token for r in rows] == [70, 70, 128]


@pytest.mark.parametrize("per_block", [False, True])
def test_swap_out_then_in_to_other_blocks_gives_back_the_kv(tiny, per_block):
    s = prepare(tiny, block_size=4, num_tokens=10, seed=1)
    with torch.inference_mode():
        s.prefill()
    n, slab = s.num_blocks, s.cache.slab
    original = slab[:, :, :n].clone()  # (2, layers, n, block_size, heads, head_dim)
    assert original.abs().sum() > 0
    if per_block:
        swap_per_block(s.cache, s.out_pairs(), "out")
    else:
        s.cache.swap_out(s.out_pairs())
    assert torch.equal(s.cache.cpu_slab[:, :, :n], original)
    slab[:, :, :n] = 0  # the device blocks are freed and reused
    if per_block:
        swap_per_block(s.cache, s.in_pairs(), "in")
    else:
        s.cache.swap_in(s.in_pairs())
    assert [d for _, d in s.in_pairs()] == list(range(n, 2 * n))  # other block ids
    assert torch.equal(slab[:, :, n : 2 * n], original)


def test_recompute_writes_the_kv_of_every_token(tiny):
    s = prepare(tiny, block_size=4, num_tokens=10, seed=2)
    with torch.inference_mode():
        s.prefill()
    k = s.cache.slab[0, :, :3].flatten(1, 2)  # (layers, 12 slots, heads, head_dim)
    assert all(k[layer, t].abs().sum() > 0 for layer in range(2) for t in range(10))
    assert k[:, 10:].abs().sum() == 0  # the last block's 2 free slots stay empty
    first = s.cache.slab.clone()
    s.cache.slab.zero_()
    with torch.inference_mode():
        s.prefill()  # the re-prefill writes the same K/V again
    assert torch.allclose(s.cache.slab, first)


def test_swap_per_block_rejects_a_bad_direction(tiny):
    s = prepare(tiny, block_size=4, num_tokens=8)
    with pytest.raises(ValueError, match="direction"):
        swap_per_block(s.cache, s.out_pairs(), "sideways")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_sizes": (0,)}, ValueError, "block size must be at least 1"),
        ({"block_sizes": (4.0,)}, TypeError, "block size must be an int"),
        ({"block_sizes": ()}, ValueError, "block_sizes is empty"),
        ({"num_tokens": 0}, ValueError, "num_tokens must be at least 1"),
        ({"repeats": 0}, ValueError, "repeats must be at least 1"),
        ({"num_tokens": 513}, ValueError, "positions"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        measure(**{"block_sizes": (4,), "num_tokens": 8, "repeats": 1, **kwargs})


def test_unknown_model_raises(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fail at once instead of asking the hub
    with pytest.raises(ModelLoadError, match="no-such-model"):
        measure((4,), num_tokens=8, model="no-such-model", repeats=1)


def test_plot_has_the_five_curves(rows):
    fig = plot_figure19(rows)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "swap out (batched)",
        "swap in (batched)",
        "swap out (one copy per block)",
        "swap in (one copy per block)",
        "recompute (prefill)",
    ]
    assert [line.get_linestyle() for line in ax.get_lines()] == ["-", "-", "--", "--", "-"]
    assert ax.get_xscale() == "log"
    assert list(ax.get_lines()[4].get_xdata()) == [1, 5, 64]
