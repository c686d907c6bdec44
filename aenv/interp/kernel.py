"""Loaded into every Jupyter kernel the code interpreter starts (never on the node).

The server (aenv.interp.server) loads this file as the module `_aenv_interp`
right after a kernel starts and calls `install`: a display formatter that adds
chart data (the E2B SDKs' `charts` types, as plain dicts) to every matplotlib
figure shown, next to the PNG the inline backend makes. `push_env`/`pop_env`
apply a run's environment variables around it; `warm` imports the data
stack once so the first user import is a lookup. Nothing here touches the
user's namespace.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

CHART_MIME = "application/vnd.aenv.chart+json"

_saved_env: list[dict[str, str | None]] = []


def push_env(envs: dict[str, str]) -> None:
    """Set `envs` in the kernel's environment for one run, remembering what was there."""
    _saved_env.append({k: os.environ.get(k) for k in envs})
    os.environ.update(envs)


def pop_env() -> None:
    """Put back what the latest `push_env` replaced."""
    if not _saved_env:
        return
    for key, value in _saved_env.pop().items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def warm() -> None:
    """Import the data stack and turn on inline figures: a sandbox restored from
    the template's snapshot then runs its first cell without importing them."""
    import matplotlib.pyplot
    import numpy
    import pandas
    from IPython import get_ipython

    del matplotlib, numpy, pandas
    ip = get_ipython()
    if ip is not None:
        ip.run_line_magic("matplotlib", "inline")


def install(ip: Any) -> None:
    """Add the chart formatter to the kernel's display formatter. It recognises
    figures itself rather than through `for_type`: turning inline figures on
    (`%matplotlib inline`, importing pyplot) removes every formatter's
    registration for `Figure`."""
    from IPython.core.formatters import BaseFormatter
    from traitlets import Unicode

    class ChartFormatter(BaseFormatter):  # type: ignore[misc]
        format_type = Unicode(CHART_MIME)
        _return_type = dict

        def __call__(self, obj: Any) -> dict[str, Any] | None:
            figure = sys.modules.get("matplotlib.figure")
            if figure is None or not isinstance(obj, figure.Figure):
                return None
            try:  # a formatter that raises prints a traceback into the user's output
                return figure_chart(obj)
            except Exception:
                return None

    ip.display_formatter.formatters[CHART_MIME] = ChartFormatter(parent=ip.display_formatter)
    if CHART_MIME not in ip.display_formatter.active_types:
        ip.display_formatter.active_types.append(CHART_MIME)


# -- chart data -------------------------------------------------------------------


def figure_chart(fig: Any) -> dict[str, Any] | None:
    """The chart data of a matplotlib figure: one chart per visible axes, a
    `superchart` holding them when there are several."""
    charts = [axes_chart(ax) for ax in fig.get_axes() if ax.get_visible()]
    if not charts:
        return None
    if len(charts) == 1:
        return charts[0]
    title = fig.get_suptitle() if hasattr(fig, "get_suptitle") else ""
    return {"type": "superchart", "title": title or None, "elements": charts}


def axes_chart(ax: Any) -> dict[str, Any]:
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    title = ax.get_title() or None
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        return {
            "type": "pie",
            "title": title,
            "elements": [
                {
                    "label": _label(w.get_label(), i),
                    "angle": _num(w.theta2 - w.theta1),
                    "radius": _num(w.r),
                }
                for i, w in enumerate(wedges)
            ],
        }
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        return _bar_chart(ax, title, bars)
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    lines = ax.get_lines()
    if scatters and not lines:
        elements = [
            {
                "label": _label(c.get_label(), i),
                "points": [[_x(ax, x), _num(y)] for x, y in c.get_offsets()],
            }
            for i, c in enumerate(scatters)
        ]
        return {"type": "scatter", "title": title, **_axes2d(ax), "elements": elements}
    if lines:
        elements = [
            {
                "label": _label(line.get_label(), i),
                "points": [
                    [_x(ax, x), _num(y)] for x, y in zip(*line.get_data(orig=False), strict=False)
                ],
            }
            for i, line in enumerate(lines)
        ]
        return {"type": "line", "title": title, **_axes2d(ax), "elements": elements}
    return {"type": "unknown", "title": title, "elements": []}


def _bar_chart(ax: Any, title: str | None, bars: list[Any]) -> dict[str, Any]:
    horizontal = getattr(bars[0], "orientation", "vertical") == "horizontal"
    axis = ax.yaxis if horizontal else ax.xaxis
    ticks = list(axis.get_majorticklocs())
    labels = _tick_labels(axis, ticks)
    elements = []
    for i, container in enumerate(bars):
        group = _label(container.get_label(), i)
        for rect in container.patches:
            if horizontal:
                where, value = rect.get_y() + rect.get_height() / 2, rect.get_width()
            else:
                where, value = rect.get_x() + rect.get_width() / 2, rect.get_height()
            label = str(_num(where))
            if ticks:
                nearest = min(range(len(ticks)), key=lambda j: abs(ticks[j] - where))
                label = labels[nearest]
            elements.append({"label": label, "group": group, "value": _num(value)})
    x_label, y_label = ax.get_xlabel() or None, ax.get_ylabel() or None
    if horizontal:
        x_label, y_label = y_label, x_label
    return {
        "type": "bar",
        "title": title,
        "x_label": x_label,
        "y_label": y_label,
        "x_unit": None,
        "y_unit": None,
        "elements": elements,
    }


def _axes2d(ax: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"x_unit": None, "y_unit": None}
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        ticks = list(axis.get_majorticklocs())
        out[f"{name}_label"] = axis.get_label_text() or None
        out[f"{name}_scale"] = _scale(axis)
        out[f"{name}_ticks"] = [_x(ax, t) if name == "x" else _num(t) for t in ticks]
        out[f"{name}_tick_labels"] = _tick_labels(axis, ticks)
    return out


def _scale(axis: Any) -> str:
    from matplotlib import category, dates

    formatter = axis.get_major_formatter()
    if isinstance(
        formatter, dates.DateFormatter | dates.AutoDateFormatter | dates.ConciseDateFormatter
    ):
        return "datetime"
    if isinstance(formatter, category.StrCategoryFormatter):
        return "categorical"
    return str(axis.get_scale())


def _tick_labels(axis: Any, ticks: list[float]) -> list[str]:
    formatter = axis.get_major_formatter()
    try:
        return [str(t) for t in formatter.format_ticks(ticks)]
    except Exception:
        return [str(_num(t)) for t in ticks]


def _x(ax: Any, value: Any) -> Any:
    """An x value as the chart types carry it: ISO text on date axes, the category
    on categorical ones, else a number."""
    scale = _scale(ax.xaxis)
    if scale == "datetime":
        from matplotlib import dates

        try:
            return dates.num2date(float(value)).isoformat()
        except (TypeError, ValueError):
            return str(value)
    if scale == "categorical":
        if isinstance(value, str):
            return value
        labels = _tick_labels(ax.xaxis, [float(value)])
        return labels[0] if labels else str(value)
    return _num(value)


def _num(value: Any) -> Any:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(f):
        return None
    return int(f) if f.is_integer() and abs(f) < 2**53 else f


def _label(label: Any, index: int) -> str:
    text = str(label) if label is not None else ""
    return "" if text.startswith("_") else text
