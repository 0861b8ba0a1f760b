"""Static drawings: the pool grid and the block tables draw exactly the manager's state."""

import matplotlib
import pytest
from matplotlib.colors import to_hex
from matplotlib.patches import ConnectionPatch
from matplotlib.text import Text

from pagedlearn import KVCacheManager
from pagedlearn.errors import PagedLearnError
from pagedlearn.viz import pool as pool_module
from pagedlearn.viz.pool import PoolArtist, PoolTooLargeError, draw_block_pool, pool_figure
from pagedlearn.viz.state import pool_state
from pagedlearn.viz.style import (
    CACHED_COLOR,
    FREE_COLOR,
    MIXED_COLOR,
    OKABE_ITO,
    Palette,
    block_color,
)
from pagedlearn.viz.tables import MAX_SEQS, draw_block_tables

BS = 4


@pytest.fixture
def kv():
    """A pool after add, fork, append with copy-on-write, and a free with prefix caching."""
    kv = KVCacheManager(12, BS, enable_prefix_caching=True, num_cpu_blocks=4)
    kv.add_sequence("a.0", [1, 2, 3, 4, 5, 6])  # blocks 0 (full), 1 (2 of 4)
    kv.fork("a.0", "a.1")  # a.1 shares 0 and 1
    kv.append_token("a.1", 7)  # writes into shared block 1: CoW -> a.1 gets block 2
    kv.add_sequence("b.0", [20, 21, 22, 23, 24, 25, 26, 27, 28])  # 3, 4 (full), 5 (1 token)
    kv.add_sequence("c.0", [40, 41, 42, 43, 44, 45, 46, 47])  # 6, 7 (full)
    kv.free_sequence("c.0")  # 6 and 7 stay cached: free, but findable
    return kv


def expected(kv, palette):
    """What must be drawn per block, worked out from the manager (not from the drawing)."""
    a, b = palette.color("a"), palette.color("b")
    rows = {
        0: (a, 1.0, "//", "0 x2"),
        1: (a, 0.5, "", "1"),
        2: (a, 0.75, "", "2"),
        3: (b, 1.0, "", "3"),
        4: (b, 1.0, "", "4"),
        5: (b, 0.25, "", "5"),
        6: (CACHED_COLOR, 1.0, "", "6"),
        7: (CACHED_COLOR, 1.0, "", "7"),
    }
    return [rows.get(i, (FREE_COLOR, 0.0, "", str(i))) for i in range(kv.allocator.num_blocks)]


def test_pool_artist_draws_the_managers_state(kv):
    assert kv.block_table("a.1") == [0, 2] and kv.pop_copies() == [(1, 2)]
    _, artist = pool_figure(12, BS)
    artist.update(pool_state(kv))
    want = expected(kv, artist.palette)
    got = artist.drawn()
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g[0] == w[0] and g[2] == w[2] and g[3] == w[3], f"block {i}: {g} != {w}"
        assert g[1] == pytest.approx(w[1]), f"block {i} fill"
    assert artist.palette.groups == ["a", "b"]
    assert "4 free" in artist.ax.get_title() and "2 cached" in artist.ax.get_title()


def test_draw_block_pool_figure_patches_match(kv):
    palette = Palette()
    fig = draw_block_pool(kv, palette=palette, title="my pool")
    ax = fig.axes[0]
    fills = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    texts = {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}
    full_width = fills["fill 0"].get_width()
    for i, (color, frac, hatch, label) in enumerate(expected(kv, palette)):
        bar = fills[f"fill {i}"]
        assert to_hex(bar.get_facecolor()) == color
        assert bar.get_width() == pytest.approx(frac * full_width)
        assert (bar.get_hatch() or "") == hatch
        assert f"{texts[f'id {i}']} {texts[f'refcount {i}']}".strip() == label
    assert ax.get_title() == "my pool"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["a", "b"] and "free, cached" in legend and "free" in legend


def test_cached_free_is_shaded_apart_from_empty_and_mixed_owners_are_grey(kv):
    kv.add_sequence("d.0", [1, 2, 3, 4, 9])  # prefix hit on block 0: shared by a and d
    state = pool_state(kv)
    assert state.blocks[0].refcount == 3
    palette = Palette()
    assert block_color(state.blocks[0], state.group_of, palette) == MIXED_COLOR
    kinds = {state.blocks[i].kind for i in (6, 7)}
    colors = {block_color(state.blocks[i], state.group_of, palette) for i in (6, 7, 11)}
    assert kinds == {"cached"} and colors == {CACHED_COLOR, FREE_COLOR}
    assert CACHED_COLOR != FREE_COLOR and CACHED_COLOR not in OKABE_ITO


def test_a_shared_palette_keeps_colours_across_drawings(kv):
    """A palette passed to several drawings of a live manager observes each: a request keeps
    its colour, and a newcomer never takes a colour on screen (tests/test_viz_colors.py has the
    rule in full)."""
    palette = Palette()
    first = draw_block_pool(kv, palette=palette)
    kv.free_sequence("a.0")
    kv.free_sequence("a.1")
    kv.add_sequence("z.0", [90, 91])
    second = draw_block_pool(kv, palette=palette)
    color = {f: {p.get_gid(): to_hex(p.get_facecolor()) for p in f.axes[0].patches} for f in
             (first, second)}  # fmt: skip
    b = palette.visible["b"]
    assert color[first]["fill 3"] == color[second]["fill 3"] == b
    assert palette.visible["z"] not in (b, to_hex(OKABE_ITO[0]))  # not b's, nor a's just freed


def test_fonts_are_at_least_10pt(kv):
    for fig in (draw_block_pool(kv, show_tokens=True), draw_block_tables(kv)):
        sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text()]
        assert sizes and min(sizes) >= 10


def test_show_tokens_prints_token_ids_without_a_tokenizer(kv):
    fig = draw_block_pool(kv, show_tokens=True)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "20 21 2…" in texts  # block 3: tokens 20..23, cut to 8 characters


class Chars:
    def decode(self, ids):
        return "".join(chr(96 + i % 26) for i in ids)


def test_show_tokens_decodes_with_a_tokenizer(kv):
    fig = draw_block_pool(kv, show_tokens=True, tokenizer=Chars())
    assert repr(Chars().decode([20, 21, 22, 23])) in [t.get_text() for t in fig.axes[0].texts]


def test_block_tables_one_arrow_per_entry_with_labels(kv):
    kv.add_sequence("s.0", [60, 61, 62])
    kv.swap_out(["s.0"])
    fig = draw_block_tables(kv)
    arrows = [a for a in fig.artists if isinstance(a, ConnectionPatch)]
    entries = {f"{s}:{j}->{b}" for s in kv.sequences() for j, b in enumerate(kv.block_table(s))}
    assert sorted(a.get_gid() for a in arrows) == sorted(entries)
    left = fig.axes[0]
    texts = [t.get_text() for t in left.texts]
    assert texts.count("logical 0") == 3 and texts.count("logical 2") == 1  # a.0, a.1, b.0
    assert sum(t.startswith("→") for t in texts) == len(entries)
    assert any("swapped out (CPU blocks 0)" in t for t in texts)
    pool_texts = [t.get_text() for t in fig.axes[1].texts]
    assert "x2" in pool_texts  # block 0: two incoming arrows, refcount shown
    sources = [a.get_gid() for a in arrows if a.get_gid().endswith("->0")]
    assert sorted(sources) == ["a.0:0->0", "a.1:0->0"]
    assert "logical -> physical" in fig.get_suptitle()


def test_block_tables_subset_limit_and_bad_inputs(kv):
    fig = draw_block_tables(kv, "b.0")
    assert {a.get_gid() for a in fig.artists} == {"b.0:0->3", "b.0:1->4", "b.0:2->5"}
    with pytest.raises(ValueError, match="no sequence 'zz'"):
        draw_block_tables(kv, ["a.0", "zz"])
    with pytest.raises(TypeError, match="seqs"):
        draw_block_tables(kv, 3.5)
    with pytest.raises(TypeError, match="Palette"):
        draw_block_tables(kv, palette=["#000"])
    big = KVCacheManager(64, BS)
    for i in range(MAX_SEQS + 2):
        big.add_sequence(f"r{i}.0", [i] * 5)
    fig = draw_block_tables(big)
    assert f"first {MAX_SEQS} of {MAX_SEQS + 2} sequences" in fig.get_suptitle()
    assert len(fig.artists) == 2 * MAX_SEQS
    empty = draw_block_tables(KVCacheManager(4, BS))
    assert "no sequences in the pool" in [t.get_text() for t in empty.axes[0].texts]


def test_bad_inputs_raise_clear_errors(kv):
    with pytest.raises(TypeError, match="KVCacheManager"):
        draw_block_pool(42)
    with pytest.raises(ValueError, match="per_row"):
        draw_block_pool(kv, per_row=0)
    with pytest.raises(TypeError, match="Palette"):
        draw_block_pool(kv, palette="okabe")
    fig, artist = pool_figure(8, BS)
    with pytest.raises(ValueError, match="12 blocks"):
        artist.update(pool_state(kv))
    with pytest.raises(TypeError, match="PoolState"):
        artist.update(kv)
    with pytest.raises(ValueError, match="num_blocks"):
        PoolArtist(fig.axes[0], 0, BS)


def test_drawing_leaves_rcparams_and_state_alone(kv):
    before = dict(matplotlib.rcParams)
    tables = {s: kv.block_table(s) for s in kv.sequences()}
    draw_block_pool(kv)
    draw_block_tables(kv)
    assert dict(matplotlib.rcParams) == before
    assert {s: kv.block_table(s) for s in kv.sequences()} == tables


def test_a_pool_too_large_to_draw_is_refused_before_anything_is_built(monkeypatch):
    """A trace within its caps may describe 4 million blocks: every pool picture refuses a pool
    above MAX_DRAWN_BLOCKS, naming the limit, before a figure or a state is built for it."""
    assert pool_module.MAX_DRAWN_BLOCKS >= 160  # the largest pool a chapter draws
    big = KVCacheManager(pool_module.MAX_DRAWN_BLOCKS + 1, BS)
    built = []
    monkeypatch.setattr(pool_module, "Figure", lambda *a, **k: built.append("figure"))
    monkeypatch.setattr(pool_module, "pool_state", lambda *a, **k: built.append("state"))
    for draw in (
        lambda: draw_block_pool(big),
        lambda: pool_figure(big.allocator.num_blocks, BS),
        lambda: PoolArtist(None, big.allocator.num_blocks, BS),
    ):
        with pytest.raises(PoolTooLargeError, match="MAX_DRAWN_BLOCKS = 4096") as info:
            draw()
        assert isinstance(info.value, (PagedLearnError, ValueError))
        assert f"{big.allocator.num_blocks} blocks" in str(info.value)
    assert built == []
    monkeypatch.undo()
    # read at each call: a course may raise (or lower) it
    monkeypatch.setattr(pool_module, "MAX_DRAWN_BLOCKS", 12)
    draw_block_pool(KVCacheManager(12, BS))
    with pytest.raises(PoolTooLargeError, match="MAX_DRAWN_BLOCKS = 12"):
        draw_block_pool(pool_state(KVCacheManager(13, BS)))
