"""What the benchmarks in bench/ share: the folder a run writes to, and their charts.

Every run writes its files (figures as JSON, the plot, logs) into one folder: `--out DIR`, or
`bench/out/<program>-<YYYYmmdd-HHMMSS>/` (git-ignored), printed when the run starts. Charts are
PNG files drawn with matplotlib, imported only when a chart is drawn (it is an optional extra,
not a dependency of the library), with the Agg backend so it runs on machines without a display;
where it is not installed the chart is skipped with one line and the run goes on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PLOT_SKIPPED", "Panel", "grouped_bars_figure", "pyplot", "run_folder"]

OUT_ROOT = Path(__file__).resolve().parent / "out"
PLOT_SKIPPED = "plot skipped: matplotlib is not installed (pip install matplotlib)"


def run_folder(program: str, out: str | os.PathLike[str] | None) -> Path:
    """The folder this run writes to (`out`, or bench/out/<program>-<YYYYmmdd-HHMMSS>), created
    and printed."""
    folder = Path(out) if out else OUT_ROOT / f"{program}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"output folder: {folder}", flush=True)
    return folder


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Panel:
    """One chart: bars of each series (a system) over the categories (part sizes)."""

    def __init__(
        self,
        title: str,
        categories: Sequence[str],
        series: Mapping[str, Sequence[float | None]],
        *,
        ylabel: str = "GB/s",
    ) -> None:
        self.title = title
        self.categories = list(categories)
        self.series = {name: list(values) for name, values in series.items()}
        self.ylabel = ylabel


def grouped_bars_figure(panels: Sequence[Panel], path: str | os.PathLike[str], *, columns: int,
                        suptitle: str = "") -> str:
    """Draw `panels` on a grid of `columns` columns (the panels of a row share their y scale)
    and write the PNG to `path`. Returns the line to print: `plot: PATH`, or `PLOT_SKIPPED`."""
    plt = pyplot()
    if plt is None:
        return PLOT_SKIPPED
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 4.2 * rows), squeeze=False, sharey="row")
    names = list(dict.fromkeys(name for panel in panels for name in panel.series))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel, colours)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[name]) for name in names]
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), frameon=False)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * (-(-len(names) // 4)), 1, 0.97))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def _draw(ax, panel: Panel, colours: Mapping[str, object]) -> None:  # type: ignore[no-untyped-def]
    count = max(1, len(panel.series))
    width = 0.8 / count
    for k, (name, values) in enumerate(panel.series.items()):
        xs = [i + (k - (count - 1) / 2) * width for i in range(len(panel.categories))]
        heights = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, heights, width, color=colours[name], label=name)
    ax.set_xticks(range(len(panel.categories)))
    ax.set_xticklabels(panel.categories)
    ax.set_ylabel(panel.ylabel)
    ax.yaxis.set_tick_params(labelleft=True)
    ax.set_title(panel.title)
    ax.grid(axis="y", alpha=0.3)
