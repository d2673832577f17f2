"""``shardtune plot OUTPUT_DIR``: a PNG of a run's loss, val_loss, lr and grad_norm from its ``metrics.jsonl``.

Rule: the file is read as it is after any run, a crashed one included: a line that is not a JSON
object with a numeric ``step`` (a line cut by a kill, bytes that are not UTF-8) is skipped and
counted, and the count and the first such line are printed; a missing file, or one with no row
to plot, is refused naming the file. A ``null`` value (a non-finite number) is a gap. matplotlib
is an optional extra (``pip install shardtune[plot]``); nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.checkpoint.layout import METRICS_NAME

# One panel per entry: its title and the columns drawn on it.
PANELS = (("loss", ("loss", "val_loss")), ("learning rate", ("lr",)), ("grad norm", ("grad_norm",)))
INSTALL = "pip install shardtune[plot]"


class PlotError(ValueError):
    """``shardtune plot`` cannot draw this run; the message names the file and the fix."""


@dataclass
class Series:
    """The plotted columns of a metrics file: ``column -> [(step, value)]`` (None: a gap), and the lines skipped."""

    columns: dict[str, list[tuple[int, float | None]]] = field(default_factory=dict)
    skipped: int = 0
    first_skipped: int | None = None


def read_series(path: Path) -> Series:
    """Every plotted column of the metrics file at ``path``; raises :class:`PlotError` naming the
    file when it is missing or holds no row to plot."""
    if not path.is_file():
        raise PlotError(f"{path}: no such file; pass the output_dir of a run (it holds {METRICS_NAME})")
    series = Series()
    wanted = [column for _, columns in PANELS for column in columns]
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError, OverflowError):
            series.skipped += 1
            series.first_skipped = series.first_skipped or number
            continue
        for column in wanted:
            value = row.get(column)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                series.columns.setdefault(column, []).append((step, float(value)))
            elif column in row:
                series.columns.setdefault(column, []).append((step, None))
    if not any(value is not None for points in series.columns.values() for _, value in points):
        raise PlotError(f"{path}: no row with {', '.join(wanted)} to plot (is the run past its first logged step?)")
    return series


def draw(series: Series, out: Path, *, title: str) -> None:
    """Write the panels that have data to the PNG ``out``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError(f"plotting needs matplotlib: {INSTALL}") from exc
    panels = [(name, [c for c in columns if c in series.columns]) for name, columns in PANELS]
    panels = [(name, columns) for name, columns in panels if columns]
    figure = Figure(figsize=(7, 2.6 * len(panels)), layout="constrained")
    figure.suptitle(title)
    for axes, (name, columns) in zip(figure.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        for column in columns:
            steps = [step for step, _ in series.columns[column]]
            values = [math.nan if value is None else value for _, value in series.columns[column]]
            marker = "o" if column == "val_loss" else None  # few points: show each
            axes.plot(steps, values, label=column, marker=marker)
        axes.set_ylabel(name)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if len(columns) > 1:
            axes.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)


def main(output_dir: Path, *, out: Path | None) -> int:
    """``shardtune plot``: 0 with the PNG written (its path printed), 1 naming the problem."""
    path = output_dir / METRICS_NAME
    target = out or output_dir / "metrics.png"
    try:
        series = read_series(path)
        draw(series, target, title=str(output_dir))
    except PlotError as exc:
        sys.stderr.write(f"shardtune plot: {exc}\n")
        return 1
    if series.skipped:
        sys.stderr.write(
            f"shardtune plot: skipped {series.skipped} line(s) of {path} that are not a metrics row "
            f"(first: line {series.first_skipped})\n"
        )
    sys.stdout.write(f"wrote {target}\n")
    return 0
