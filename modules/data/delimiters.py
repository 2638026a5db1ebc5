"""A CSV file's delimiter, found from its first lines: the one of
:data:`~persia_planner.model.data_schema.CSV_DELIMITERS` that splits the header into the most columns and every
first line into as many (quotes honoured, as pyarrow reads them).

``persia data profile`` finds it (a tab-separated file is no one-column CSV) and writes it to ``data:``; the readers
then read with the schema's, and :func:`described_delimiter` names it in errors.
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass

from persia_planner.errors import SpecError, first_line
from persia_planner.model.data_schema import CSV_DELIMITERS, DEFAULT_DELIMITER

__all__ = ["SNIFF_BYTES", "SNIFF_LINES", "Delimited", "described_delimiter", "sniff_delimiter"]

SNIFF_BYTES = 1 << 20
"""The bytes read from a file's start to find its delimiter."""
SNIFF_LINES = 200
"""The most lines (the header's included) the delimiter must split alike."""


def described_delimiter(delimiter: str) -> str:
    """``delimiter`` as an error message or a table names it (a tab is otherwise invisible)."""
    return "tab" if delimiter == "\t" else repr(delimiter)


@dataclass(frozen=True)
class Delimited:
    """How one delimiter splits a file's first lines.

    Attributes:
        delimiter: The delimiter.
        columns: The header's columns.
        bad_line: The first line (1-based) split into another count of columns (0: none).
        bad_columns: Its count.
    """

    delimiter: str
    columns: int
    bad_line: int = 0
    bad_columns: int = 0

    @property
    def fits(self) -> bool:
        """Two or more columns, and every line read of the header's count."""
        return self.columns >= 2 and not self.bad_line


def _split(lines: list[str], delimiter: str) -> Delimited:
    rows = csv.reader(lines, delimiter=delimiter, quotechar='"', strict=False)
    try:
        counts = [len(r) for r in rows]
    except csv.Error:  # a field past the csv module's limit (128 KiB): no column split by this delimiter
        return Delimited(delimiter, 0)
    header = counts[0] if counts else 0
    bad = next((i for i, n in enumerate(counts) if n != header), None)
    if bad is None:
        return Delimited(delimiter, header)
    return Delimited(delimiter, header, bad + 1, counts[bad])


def sniff_delimiter(path: str) -> str:
    """The delimiter of CSV file ``path`` (plain or ``.gz``): of those that split its first lines (at most
    :data:`SNIFF_LINES`, in its first :data:`SNIFF_BYTES`) into the header's count of columns, two or more, the one
    of the most columns; ties go to the earlier of :data:`CSV_DELIMITERS`.

    A file without a line gets the default (a comma): the readers' checks name what it is.

    Raises:
        SpecError: The file cannot be read, or no delimiter splits its lines into columns (the line that breaks
            the best one named).
    """
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            start = f.read(SNIFF_BYTES + 1)
    except (OSError, EOFError) as err:
        raise SpecError(path, "", f"cannot read it ({first_line(err)})") from None
    whole = len(start) <= SNIFF_BYTES
    text = start[:SNIFF_BYTES].decode("utf-8", errors="replace")
    lines = text.splitlines()
    if not whole and len(lines) > 1:
        lines = lines[:-1]  # cut by the read, not by a newline (a header longer than the read still shows its own)
    lines = [line for line in lines[:SNIFF_LINES] if line.strip()]
    if not lines:  # nothing to split: the readers' checks name an empty file
        return DEFAULT_DELIMITER
    splits = [_split(lines, d) for d in CSV_DELIMITERS]
    fitting = [s for s in splits if s.fits]
    if fitting:
        return max(fitting, key=lambda s: s.columns).delimiter  # max keeps the first of equals
    best = max(splits, key=lambda s: s.columns)
    if best.columns < 2:
        problem = "its header is one column: none of ',', tab, '|', ';' separates its names"
    else:
        problem = (
            f"no delimiter splits its lines into columns: by {described_delimiter(best.delimiter)} the header has "
            f"{best.columns} and line {best.bad_line} {best.bad_columns}"
        )
    raise SpecError(
        path,
        "",
        problem,
        fixes=("give a CSV file: a header of column names, then rows of as many fields", "pass --delimiter CHAR"),
    )
