"""``plot RESULTS.json``: PNGs next to the JSON (time vs vocab, memory vs tokens, roofline fraction).

Each figure has one panel per op and one line (or bar group) per backend / baseline, on the
unmasked fp32 cases (bf16 when there is no fp32 case).
"""
import json
from pathlib import Path


def _pick(rows, mode):
    """Timed, unmasked rows of ``mode`` in the preferred dtype."""
    rows = [r for r in rows if r["kind"] != "bandwidth" and r["time_ms_median"] is not None
            and r["mode"] == mode and r["masked_frac"] == 0]
    dtypes = {r["dtype"] for r in rows}
    dtype = "fp32" if "fp32" in dtypes else min(dtypes, default=None)
    return [r for r in rows if r["dtype"] == dtype]


def _most_common(rows, field):
    values = [r[field] for r in rows]
    return max(set(values), key=values.count) if values else None


def _lines(ax, rows, x, y, scale=1.0):
    for name in dict.fromkeys(r["backend"] for r in rows):
        points = sorted((r[x], r[y] * scale) for r in rows if r["backend"] == name and r[y] is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=name)


def plot(results: Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(Path(results).read_text())
    ops = list(dict.fromkeys(r["op"] for r in rows))
    title = f"{rows[0]['device_name']}  (torch {rows[0]['torch']}, commit {rows[0]['commit'][:10]})"
    written = []

    def figure(name, draw, ylabel, xlabel, logy=True):
        fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.5), squeeze=False)
        for ax, op in zip(axes[0], ops):
            subtitle = draw(ax, [r for r in rows if r["op"] == op])
            ax.set_title(f"{op}\n{subtitle}", fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if logy:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = Path(results).with_name(f"{Path(results).stem}_{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def time_vs_vocab(ax, op_rows):
        picked = _pick(op_rows, "forward")
        tokens = _most_common(picked, "tokens")
        _lines(ax, [r for r in picked if r["tokens"] == tokens], "vocab", "time_ms_median")
        return f"forward, {tokens} tokens"

    def memory_vs_tokens(ax, op_rows):
        picked = _pick(op_rows, "fwd_bwd")
        vocab = _most_common(picked, "vocab")
        _lines(ax, [r for r in picked if r["vocab"] == vocab], "tokens", "peak_mem_bytes", 1 / 2**20)
        return f"forward+backward peak above inputs, vocab {vocab}"

    def roofline(ax, op_rows):
        modes = ("forward", "backward", "fwd_bwd")
        picked = [r for m in modes for r in _pick(op_rows, m)]
        if not picked:
            return "no data"
        largest = max(picked, key=lambda r: r["tokens"] * r["vocab"])
        shape = (largest["tokens"], largest["vocab"])
        picked = [r for r in picked if (r["tokens"], r["vocab"]) == shape]
        names = list(dict.fromkeys(r["backend"] for r in picked))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            by_name = {r["backend"]: r["roofline_frac"] for r in picked if r["mode"] == mode}
            ax.bar([j + i * width for j in range(len(names))], [by_name.get(n, 0) for n in names], width, label=mode)
        ax.set_xticks([j + width for j in range(len(names))], names, rotation=45, ha="right", fontsize=7)
        return f"achieved / measured bandwidth, {shape[0]} x {shape[1]} {largest['dtype']}"

    figure("time_vs_vocab", time_vs_vocab, "median ms", "vocab")
    figure("memory_vs_tokens", memory_vs_tokens, "MiB", "tokens")
    figure("roofline", roofline, "fraction of measured bandwidth", "", logy=False)
    return written
