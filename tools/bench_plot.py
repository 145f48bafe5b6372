"""``linerate bench --plot``: busbw (Gbit/s) against message size, one panel per collective,
one line per backend, and the raw link capacity (``--raw``) as a horizontal line."""
from __future__ import annotations

import importlib.util

from linerate.tools.bench_report import Row

INSTALL_HINT = "needs matplotlib, which is not installed: pip install matplotlib"


def matplotlib_missing() -> str | None:
    """None if matplotlib can be imported, else a message telling how to install it."""
    return None if importlib.util.find_spec("matplotlib") is not None else INSTALL_HINT


def _size_label(nbytes: float, _pos=None) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes:g}"


def plot_busbw(path: str, labels: list[str], rows: list[Row], capacity_gbit_s: float | None,
               title: str) -> None:
    """Write a PNG to ``path``; raises RuntimeError naming the fix if matplotlib is missing."""
    missing = matplotlib_missing()
    if missing:
        raise RuntimeError(f"--plot {missing}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    ops = list(dict.fromkeys(row.op for row in rows))
    fig, axes = plt.subplots(len(ops) or 1, 1, figsize=(8, 3.2 * max(len(ops), 1) + 0.6),
                             squeeze=False, sharex=True)
    for ax, op in zip(axes[:, 0], ops or [None]):
        op_rows = [row for row in rows if row.op == op]
        sizes = [row.size_bytes for row in op_rows]
        for i, label in enumerate(labels):
            gbit = [row.results[i].busbw_gbps * 8 for row in op_rows]
            ax.plot(sizes, gbit, marker="o", label=label)
        if capacity_gbit_s is not None:
            ax.axhline(capacity_gbit_s, color="black", linestyle="--",
                       label=f"raw link capacity {capacity_gbit_s:.2f} Gbit/s")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2))
        ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
        ax.set_ylim(bottom=0)
        ax.set_ylabel("busbw (Gbit/s)")
        ax.set_title(op or "no results")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("message size (bytes)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
