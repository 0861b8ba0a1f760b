"""Figures for the paper experiments: ours beside the paper's, one call per figure.

Each function takes the tidy rows an experiment in :mod:`pagedlearn.sim.paper` returns and gives
back a matplotlib ``Figure`` (a notebook shows it; :func:`save_all` writes PNGs). They use no
pyplot, so they neither open windows nor change a notebook's backend.
Colours are the Okabe-Ito palette, which reads for colour-blind eyes; fonts are at least 10 pt so
that a figure stays readable on a projector.
"""

import functools

import matplotlib
from matplotlib.figure import Figure  # no pyplot: no global state, no backend switching

OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000"]
LABELS = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)", "vllm": "vLLM"}
FIG2_PARTS = [  # (column, paper column, label)
    ("token_states", "paper_token_states", "token states"),
    ("reserved", "paper_reserved", "reserved"),
    ("internal", "paper_internal", "internal frag."),
    ("external_and_other", "paper_external_and_other", "external frag. and other"),
]
STYLE = {"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10}


def _styled(draw):
    """Draw under the project's font sizes without changing the caller's matplotlib settings."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return draw(*args, **kwargs)

    return wrapper


@_styled
def plot_figure2(rows):
    """Stacked bars: where the KV pool goes, ours (solid) and the paper's (hatched) per system."""
    fig = Figure(figsize=(9, 4.8))
    ax = fig.subplots()
    x = 0
    ticks, names = [], []
    for row in rows:
        for source, offset in (("ours", 0), ("paper", 0.85)):
            bottom = 0.0
            for i, (ours, theirs, label) in enumerate(FIG2_PARTS):
                value = row[ours] if source == "ours" else row[theirs]
                if value is None:  # the paper breaks down only vLLM's 96.3% of token states
                    continue
                first = source == "ours" and row is rows[0]  # one legend entry per part
                ax.bar(x + offset, value, 0.8, bottom=bottom, color=OKABE_ITO[i],
                       hatch="//" if source == "paper" else None, edgecolor="white",
                       label=label if first else None)  # fmt: skip
                bottom += value
        ticks += [x, x + 0.85]
        names += ["ours", "paper"]
        ax.text(x + 0.425, -13, LABELS[row["system"]], ha="center", va="top", clip_on=False)
        x += 2.2
    ax.set_xticks(ticks, names, fontsize=10)
    ax.set_ylabel("% of the KV-cache pool")
    ax.set_ylim(0, 100)
    ax.set_title("Figure 2: where the KV pool goes (ShareGPT-like, OPT-13B)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


@_styled
def plot_figure13(rows_by_workload):
    """Grouped bars: average batched requests per system, ours and the paper's, per workload."""
    fig = Figure(figsize=(9, 4))
    axes = fig.subplots(1, len(rows_by_workload))
    for ax, (workload, rows) in zip(axes, rows_by_workload.items(), strict=True):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["mean_batch"] for r in rows], 0.4,
               color=OKABE_ITO[0], label="ours")  # fmt: skip
        ax.bar([x + 0.2 for x in xs], [r["paper_mean_batch"] for r in rows], 0.4,
               color=OKABE_ITO[1], hatch="//", edgecolor="white", label="paper")  # fmt: skip
        ax.set_xticks(list(xs), [LABELS[r["system"]].replace(" ", "\n", 1) for r in rows])
        ax.set_title(f"{workload}-like")
        ax.set_ylabel("average batched requests")
    axes[0].legend()
    fig.suptitle("Figure 13: batch size each memory model allows (saturated server)")
    fig.tight_layout()
    return fig


@_styled
def plot_figure18b(rows_by_workload):
    """Lines: paging's internal waste and batch size as the block size grows."""
    fig = Figure(figsize=(9, 4))
    waste, batch = fig.subplots(1, 2)
    for i, (workload, rows) in enumerate(rows_by_workload.items()):
        sizes = [r["block_size"] for r in rows]
        kw = {"color": OKABE_ITO[i], "marker": "o", "label": f"{workload}-like"}
        waste.plot(sizes, [r["internal"] for r in rows], **kw)
        batch.plot(sizes, [r["mean_batch"] for r in rows], **kw)
    for ax, label in ((waste, "internal fragmentation, % of pool"), (batch, "average batch")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("Figure 18b (memory side): paging vs block size")
    fig.tight_layout()
    return fig


@_styled
def plot_figure15(rows):
    """Bars: % memory saved by sharing per mode and width; the paper's bars (Alpaca) or ranges
    (ShareGPT, where it gives only a range per mode) beside ours."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, len(workloads))
    for ax, workload in zip(axes, workloads, strict=True):
        mine = [r for r in rows if r["workload"] == workload]
        xs = list(range(len(mine)))
        ax.bar([x - 0.2 for x in xs], [r["saved_pct"] for r in mine], 0.4, color=OKABE_ITO[0],
               label="ours")  # fmt: skip
        for x, r in zip(xs, mine, strict=True):
            paper = r["paper_saved_pct"]
            if isinstance(paper, str):  # "low-high": draw the range
                low, high = (float(v) for v in paper.split("-"))
                ax.bar(x + 0.2, high - low, 0.4, bottom=low, color=OKABE_ITO[1], alpha=0.5,
                       label="paper (range)" if x == 0 or x == 3 else None)  # fmt: skip
            else:
                ax.bar(x + 0.2, paper, 0.4, color=OKABE_ITO[1], hatch="//", edgecolor="white",
                       label="paper" if x == 0 else None)  # fmt: skip
        ax.set_xticks(xs, [f"{r['mode']}\n{r['width']}" for r in mine], fontsize=10)
        ax.set_ylabel("% KV memory saved")
        ax.set_title(f"{workload}-like")
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(dict(zip(labels, handles, strict=True)).values(), dict.fromkeys(labels))
    fig.suptitle("Figure 15: memory saved by sharing blocks (parallel sampling, beam search)")
    fig.tight_layout()
    return fig


@_styled
def plot_sensitivity(rows):
    """Lines: each system's batch size as the length distribution's spread varies."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for i, system in enumerate(LABELS):
        mine = [r for r in rows if r["system"] == system]
        ax.plot([r["spread"] for r in mine], [r["mean_batch"] for r in mine], marker="o",
                color=OKABE_ITO[i], label=LABELS[system])  # fmt: skip
    ax.axvline(1.0, color="grey", linestyle=":", label="our choice")
    ax.set_xlabel("spread (x our sigma)")
    ax.set_ylabel("average batched requests")
    ax.set_title("How much the spread we chose matters (ShareGPT-like)")
    ax.legend()
    fig.tight_layout()
    return fig


@_styled
def plot_prefix_caching(rows):
    """Bars: hit rate per stream, cache off / cold / warm."""
    streams = list(dict.fromkeys(r["stream"] for r in rows))
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for i, cache in enumerate(("off", "cold", "warm")):
        values = [next(r["hit_rate_pct"] for r in rows if r["stream"] == s and r["cache"] == cache)
                  for s in streams]  # fmt: skip
        ax.bar([x + (i - 1) * 0.27 for x in range(len(streams))], values, 0.27,
               color=OKABE_ITO[i], label=f"cache {cache}")  # fmt: skip
    ax.set_xticks(range(len(streams)), streams)
    ax.set_ylabel("prompt tokens found in the cache, %")
    ax.set_title("Prefix caching: hit rate (many chats: LRU evicts histories before reuse)")
    ax.legend()
    fig.tight_layout()
    return fig


@_styled
def plot_figure12(rows, summary):
    """Lines over the request rate: normalized latency (left) and requests running together
    (right), paged engine vs max-length reservation, with the target latency and each system's
    sustainable rate (rows and summary of :func:`pagedlearn.sim.serving_latency.measure`)."""
    fig = Figure(figsize=(11, 5))
    latency, running = fig.subplots(1, 2)
    systems = {"paged": ("paged (vLLM-style)", OKABE_ITO[3], "o"),
               "max": ("max-length reservation (Orca (Max)-style)", OKABE_ITO[0], "s")}  # fmt: skip
    for system, (label, colour, marker) in systems.items():
        mine = [r for r in rows if r["system"] == system]
        rates = [r["rate"] for r in mine]
        kw = {"color": colour, "marker": marker, "linewidth": 2}
        latency.plot(rates, [1e3 * r["normalized_latency"] for r in mine], label=label, **kw)
        running.plot(rates, [r["mean_running"] for r in mine], **kw)
        if summary[f"sustainable_{system}"]:
            latency.axvline(summary[f"sustainable_{system}"], color=colour, linestyle=":")
    target = 1e3 * summary["target_latency"]
    said = f"target: {summary['knee']:g} x unloaded = {target:.2f} ms/token"
    latency.axhline(target, color="grey", linestyle="--", linewidth=1, label=said)
    limit = summary["budget_tokens"] / summary["max_len"]
    running.axhline(limit, color=OKABE_ITO[0], linestyle="--", linewidth=1,
                    label=f"max-length reservations that fit: {limit:.0f}")  # fmt: skip
    running.legend(loc="upper left", fontsize=10)
    latency.set_ylabel("normalized latency (ms / output token)")
    latency.set_title("latency (dotted: sustainable rates)")
    running.set_ylabel("mean requests running together")
    running.set_title("why: how many fit in the KV budget")
    for ax in (latency, running):
        ax.set_xlabel("request rate (requests / s, simulated clock)")
        ax.set_ylim(bottom=0)
    ratio = f"{summary['ratio']:.2f}x" if summary["ratio"] else "n/a"
    fig.suptitle(f"Figure 12, measured: {summary['model']}, context {summary['max_len']}, "
                 f"{summary['budget_tokens']} KV slots, clock: {summary['clock']}\n"
                 f"sustainable rate, paged / max: {ratio} (paper: 2.7-8x vs Orca (Max), "
                 f"1.7-2.7x vs Orca (Oracle))")  # fmt: skip
    fig.legend(*latency.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def save_all(figures: dict, directory, data: dict | None = None) -> list:
    """Write each figure as ``<name>.png`` into ``directory``; return the paths. ``data``: the
    numbers each figure draws, by the same names, merged into ``directory``'s :data:`DATA`
    (:func:`save_data`)."""
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures.items():
        path = directory / f"{name}.png"
        fig.savefig(path, dpi=120)
        paths.append(path)
    if data is not None:
        save_data(data, directory)
    return paths


DATA = "data.json"  # beside the PNGs: the numbers each one draws, by figure name


def save_data(data: dict, directory):
    """Merge ``data`` (figure name -> JSON-able numbers) into ``directory / DATA``: the entries
    of other figures already there are kept, so ``figures`` and ``paper`` each write theirs.
    Lists of plain values stay on one line, so a diff shows which figure's numbers moved."""
    import json
    from pathlib import Path

    path = Path(directory) / DATA
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(json.loads(json.dumps(data)))  # tuples become lists, keys strings
    path.write_text(_dumps(dict(sorted(merged.items()))) + "\n")
    return path


def _dumps(value, indent: str = "") -> str:
    import json

    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value)
