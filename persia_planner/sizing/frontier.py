"""The cost / throughput frontier of a sizing: the shapes no cheaper shape outruns, as rows and as a picture.

A shape's throughput is its plan's estimate where it was planned, else the ceiling a bound put on it (no plan there
can be faster): the picture draws the two apart. matplotlib is imported only inside :func:`draw_frontier`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from persia_planner.sizing.sizer import Sizing, Verdict

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["draw_frontier", "frontier", "frontier_rows"]


def frontier(sizing: Sizing) -> list[Verdict]:
    """The shapes of ``sizing`` whose speed (planned, else its ceiling) beats every cheaper shape's, cheapest
    first; the chosen shape is always among them."""
    known = [v for v in sizing.verdicts if v.best_known is not None]
    known.sort(key=lambda v: (v.shape.price_per_hour, -(v.best_known or 0.0)))
    kept: list[Verdict] = []
    fastest = -1.0
    for verdict in known:
        speed = verdict.best_known or 0.0
        if speed > fastest or verdict is sizing.chosen:
            kept.append(verdict)
            fastest = max(fastest, speed)
    return kept


def frontier_rows(sizing: Sizing, currency: str) -> list[dict[str, Any]]:
    """:func:`frontier` as table rows: shape, price, samples/s (``<= N`` for a ceiling), and what limits it."""
    rows = []
    for verdict in frontier(sizing):
        speed = (
            f"{verdict.samples_per_s:,.0f}"
            if verdict.samples_per_s is not None
            else f"<= {verdict.ceiling_samples_per_s:,.0f}"
        )
        rows.append(
            {
                "shape": verdict.shape.describe(),
                "price": f"{verdict.shape.price_per_hour:,.2f} {currency}/h",
                "samples/s": speed,
                "verdict": "meets the target" if verdict.meets else (verdict.resource or "").__str__(),
            }
        )
    return rows


def draw_frontier(sizing: Sizing, currency: str, title: str = "") -> Figure:
    """Price per hour against samples/s of every shape the sizing looked at: planned ones as dots, bounded ones as
    their ceilings (down-triangles: no faster than that), the frontier as a step line, the target as a horizontal
    line and the chosen shape as a star."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 5.0))
    ax = fig.add_subplot()
    planned = [(v.shape.price_per_hour, v.samples_per_s) for v in sizing.verdicts if v.samples_per_s is not None]
    bounded = [
        (v.shape.price_per_hour, v.ceiling_samples_per_s)
        for v in sizing.verdicts
        if v.samples_per_s is None and v.ceiling_samples_per_s is not None
    ]
    styles = (
        (bounded, {"marker": "v", "s": 22, "color": "#999999", "label": "ceiling by the bound (not planned)"}),
        (planned, {"marker": "o", "s": 30, "color": "#4c72b0", "label": "planned"}),
    )
    for points, style in styles:
        if points:
            ax.scatter([price for price, _ in points], [speed for _, speed in points], **style)
    line = frontier(sizing)
    if line:
        ax.step(
            [v.shape.price_per_hour for v in line],
            [v.best_known for v in line],
            where="post",
            color="#4c72b0",
            alpha=0.5,
            label="frontier",
        )
    ax.axhline(sizing.target_samples_per_s, color="#c44e52", linestyle="--", label="target")
    if sizing.chosen is not None:
        chosen = sizing.chosen
        ax.scatter(
            [chosen.shape.price_per_hour],
            [chosen.samples_per_s],
            marker="*",
            s=220,
            color="#dd8452",
            zorder=5,
            label=f"chosen: {chosen.shape.describe()}",
        )
    ax.set_xlabel(f"price ({currency} per hour)")
    ax.set_ylabel("samples / s (estimate)")
    ax.set_title(title or "cost / throughput of the shapes sized")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig
