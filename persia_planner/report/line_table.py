"""A rich renderable for the report's big tables: laid out as ``rich.table.Table(title=..., title_justify="left")``
lays out one line per row, without rich's per-cell layout.

rich renders every cell through its text wrapping and alignment; on 1,000 tables that is most of ``persia plan``'s
printing (~0.3 s). :class:`LineTable` writes the same characters (the heavy-headed box, one space of padding, the
columns' justification, the title padded to the table's width) with the same styles, when every cell is plain text on
one line that fits; otherwise :meth:`LineTable.of` gives None and the caller keeps rich's table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions
    from rich.measure import Measurement
    from rich.segment import Segment

__all__ = ["LineTable"]

# What rich would read as markup or an emoji code, or lay out over more than one line (with ASCII only, a character is
# one cell wide).
_SPECIAL = ("[", ":", "\n", "\r", "\t", "\x1b")


class LineTable:
    """A titled table of one-line plain-text cells, rendered as rich renders a ``Table`` of them.

    Build it with :meth:`of`.
    """

    def __init__(self, title: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[str, ...]]):
        from rich.cells import cell_len

        self.title = title
        self.columns = columns
        self.rows = rows
        self.widths = [
            max([cell_len(header), *(cell_len(row[i]) for row in rows)]) + 2 for i, (header, _) in enumerate(columns)
        ]
        self.width = sum(self.widths) + len(self.widths) + 1

    @classmethod
    def of(cls, title: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[str, ...]]) -> LineTable | None:
        """The table, or None where a cell (or the title) is not plain one-line ASCII text, or it has no rows."""
        if not rows or not columns:
            return None
        text = "".join(["".join(row) for row in rows]) + title + "".join(h for h, _ in columns)
        if any(c in text for c in _SPECIAL) or not (text.isascii() and text.isprintable()):
            return None
        return cls(title, columns, rows)

    def fits(self, console: Console) -> bool:
        """Whether rich would lay it out the same way on ``console``: it fits the width, and the box is unicode."""
        options = console.options
        return self.width <= console.width and not options.ascii_only and not options.legacy_windows

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        from rich.measure import Measurement

        return Measurement(self.width, self.width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Segment]:
        from rich.segment import Segment
        from rich.style import Style

        widths = self.widths
        border = console.get_style("")
        header_style = console.get_style("table.header")
        title_style = console.get_style("table.title")
        new_line = Segment.line()

        def cells(values: Sequence[str]) -> list[str]:
            out = []
            for value, width, (_, justify) in zip(values, widths, self.columns, strict=True):
                text = value.rjust(width - 2) if justify == "right" else value.ljust(width - 2)
                out.append(f" {text} ")
            return out

        yield Segment(self.title.ljust(self.width), title_style)
        yield new_line
        yield Segment("┏" + "┳".join("━" * w for w in widths) + "┓", border)
        yield new_line
        pad = Segment(" ", header_style)
        yield Segment("┃", border)
        for i, cell in enumerate(cells([h for h, _ in self.columns])):
            if i:
                yield Segment("┃", border)
            yield from (pad, Segment(cell[1:-1], header_style), pad)
        yield Segment("┃", border)
        yield new_line
        yield Segment("┡" + "╇".join("━" * w for w in widths) + "┩", border)
        yield new_line
        plain = Style.null()
        for row in self.rows:
            yield Segment("│" + "│".join(cells(row)) + "│", plain)
            yield new_line
        yield Segment("└" + "┴".join("─" * w for w in widths) + "┘", border)
        yield new_line
