"""``plot RESULTS.json``: PNGs next to the JSON (time vs vocab, memory vs tokens, roofline fraction).

Each figure has one panel per op and one line (or bar group) per backend / baseline, on the
unmasked fp32 cases (bf16 when there is no fp32 case, the least masked cases when none is
unmasked; the panel title says which). Backends whose lines coincide share one line labelled
``a ≈ b``: drawn apart, the last one would hide the others. A figure with nothing to draw is
not written, with a warning.
"""
import json
import warnings
from pathlib import Path

# Lines closer than this (relative, at every point) are drawn as one: on the log-scale panels
# that is about a line's width.
COINCIDE = 0.02


def _pick(timed, mode):
    """The timed rows of ``mode`` with the least masked fraction, in the preferred dtype."""
    rows = [r for r in timed if r["mode"] == mode]
    masked = min((r["masked_frac"] for r in rows), default=None)
    rows = [r for r in rows if r["masked_frac"] == masked]
    dtypes = {r["dtype"] for r in rows}
    dtype = "fp32" if "fp32" in dtypes else min(dtypes, default=None)
    return [r for r in rows if r["dtype"] == dtype]


def _cases(picked) -> str:
    """dtype and masked fraction of ``_pick``'s rows, for a panel title."""
    return f"{picked[0]['dtype']}, {picked[0]['masked_frac']:.0%} masked" if picked else ""


def _most_common(rows, field):
    values = [r[field] for r in rows]
    return max(set(values), key=values.count) if values else None


def _coincide(a, b) -> bool:
    return [x for x, _ in a] == [x for x, _ in b] and all(
        abs(ya - yb) <= COINCIDE * max(abs(ya), abs(yb)) for (_, ya), (_, yb) in zip(a, b))


def _lines(ax, rows, x, y, scale=1.0):
    """One line per backend, in row order; coinciding backends share a line labelled ``a ≈ b``."""
    lines = []  # (names, points)
    for name in dict.fromkeys(r["backend"] for r in rows):
        points = sorted((r[x], r[y] * scale) for r in rows if r["backend"] == name and r[y] is not None)
        if not points:
            continue
        same = next((names for names, other in lines if _coincide(other, points)), None)
        if same is None:
            lines.append(([name], points))
        else:
            same.append(name)
    for names, points in lines:
        ax.plot(*zip(*points), marker="o", label=" ≈ ".join(names))


def plot(results: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter, SymmetricalLogLocator

    rows = json.loads(Path(results).read_text())
    timed = [r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None]
    if not timed:
        warnings.warn(f"plot: {results} has no timed rows; nothing written", stacklevel=2)
        return []
    ops = list(dict.fromkeys(r["op"] for r in timed))
    title = f"{timed[0]['device_name']}  (torch {timed[0]['torch']}, commit {timed[0]['commit'][:10]})"
    written = []

    def figure(name, draw, ylabel, xlabel):
        fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.5), squeeze=False)
        empty = []
        for ax, op in zip(axes[0], ops):
            subtitle = draw(ax, [r for r in timed if r["op"] == op])
            if not ax.has_data():
                empty.append(op)
                subtitle = "nothing to plot"
            ax.set_title(f"{op}\n{subtitle}", fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        path = Path(results).with_name(f"{Path(results).stem}_{name}.png")
        if empty:
            skipped = len(empty) == len(ops)
            warnings.warn(f"plot: {path.name}: nothing to plot for {', '.join(empty)}"
                          + ("; not written" if skipped else ""), stacklevel=3)
            if skipped:
                plt.close(fig)
                return
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def time_vs_vocab(ax, op_rows):
        picked = _pick(op_rows, "forward")
        tokens = _most_common(picked, "tokens")
        _lines(ax, [r for r in picked if r["tokens"] == tokens], "vocab", "time_ms_median")
        ax.set_yscale("log")
        return f"forward, {tokens} tokens, {_cases(picked)}"

    def memory_vs_tokens(ax, op_rows):
        picked = _pick(op_rows, "fwd_bwd")
        vocab = _most_common(picked, "vocab")
        _lines(ax, [r for r in picked if r["vocab"] == vocab], "tokens", "peak_mem_bytes", 1 / 2**20)
        # symlog: a peak of 0 MiB (nothing allocated above the inputs) stays on the axis; log drops it.
        ax.set_yscale("symlog", linthresh=1.0)
        ax.yaxis.set_major_locator(SymmetricalLogLocator(linthresh=1.0, base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        return f"fwd+bwd peak above inputs, vocab {vocab}, {_cases(picked)}"

    def roofline(ax, op_rows):
        modes = ("forward", "backward", "fwd_bwd")
        picked = [r for m in modes for r in _pick(op_rows, m)]
        if not picked:
            return None  # figure() titles the empty panel
        largest = max(picked, key=lambda r: r["tokens"] * r["vocab"])
        shape = (largest["tokens"], largest["vocab"])
        picked = [r for r in picked if (r["tokens"], r["vocab"]) == shape]
        names = list(dict.fromkeys(r["backend"] for r in picked))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            by_name = {r["backend"]: r["roofline_frac"] for r in picked if r["mode"] == mode}
            ax.bar([j + i * width for j in range(len(names))], [by_name.get(n, 0) for n in names], width, label=mode)
        ax.set_xticks([j + width for j in range(len(names))], names, rotation=45, ha="right", fontsize=7)
        return f"achieved / measured bandwidth, {shape[0]} x {shape[1]}, {_cases(picked)}"

    figure("time_vs_vocab", time_vs_vocab, "median ms", "vocab")
    figure("memory_vs_tokens", memory_vs_tokens, "MiB", "tokens")
    figure("roofline", roofline, "fraction of measured bandwidth", "")
    return written
