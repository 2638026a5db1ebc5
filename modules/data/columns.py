"""What one column of a click log holds, folded a block at a time: ``persia data profile``'s per-column statistics.

Per column: its rows and missing values; for a column of ids, an estimate of its distinct ids (an HLL sketch,
Apache DataSketches, of the ids hashed as training hashes them: :func:`.ids.hash_ids`); for a numeric column, its
range, mean, share of negative values and quantiles (a KLL sketch), from which :mod:`.roles` tells a count from a
code; for text, whether its cells are lists of ids (multi-hot) and what separates them.

Torch-free; the cost is linear in the values (each block's arrays, never a Python loop over rows but the sketch's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from persia_planner.modules.data.source import fits_dense, fits_sparse

__all__ = ["KLL_K", "SEPARATORS", "SKETCH_LG_K", "ColumnProfile"]

SKETCH_LG_K = 14
"""log2 of the HLL sketch's registers: about 0.8% relative error on a distinct count."""
KLL_K = 200
"""The KLL sketch's accuracy parameter: about 1.3% rank error on a quantile."""
SEPARATORS = ("|", ";", " ")
"""What may stand between the ids of a text cell (a comma cannot, unquoted), in the order they are tried."""


@dataclass
class ColumnProfile:
    """One column of the log, as its blocks are folded in (:meth:`fold`), then :meth:`finish` ed.

    Attributes:
        name: The column.
        kind: ``numeric``, ``text`` (strings, or a CSV's values that are not all numbers), ``list`` (multi-hot: a
            list column, or a CSV's text with a ``separator`` between ids in most rows) or ``other`` (a Parquet type
            the readers take neither as numbers nor as ids: bytes, dates, structs).
        separator: The string between a CSV cell's ids (None: one id per cell).
        rows: Rows read.
        missing: Rows without a value.
        distinct: Estimated distinct ids (text, list and integer columns; None otherwise).
        low, high, mean: A numeric column's range and mean (None otherwise; the mean also where the sum overflows).
        integral: Every numeric value is a whole number.
        negatives: A numeric column's negative values.
        median: A numeric column's median (an estimate, :data:`KLL_K`; None otherwise).
    """

    name: str
    kind: str = "numeric"
    rows: int = 0
    missing: int = 0
    distinct: float | None = None
    low: float | None = None
    high: float | None = None
    mean: float | None = None
    integral: bool = True
    separator: str | None = None
    negatives: int = 0
    median: float | None = None
    _sum: float = 0.0  # of a numeric column's values
    _count: int = 0
    _ids: int = 0  # of a multi-hot column's ids
    _sketch: Any = field(default=None, repr=False)
    _quantiles: Any = field(default=None, repr=False)

    @property
    def binary(self) -> bool:
        """Every value is 0 or 1."""
        return self.kind == "numeric" and self.low is not None and self.low >= 0 and self.high <= 1 and self.integral

    @property
    def pooling(self) -> float:
        """A multi-hot column's ids per row that has a value."""
        return self._ids / max(1, self.rows - self.missing)

    @property
    def present(self) -> int:
        """Rows with a value."""
        return self.rows - self.missing

    @property
    def numbers(self) -> int:
        """A numeric column's finite values."""
        return self._count

    def fold(self, values: Any, *, text_ids: bool) -> None:
        """Fold one block of the column (a pyarrow array) in. ``text_ids``: a CSV's cells, all read as text, which
        are numbers where every one casts to a float."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from persia_planner.modules.data.ids import hash_ids

        values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
        self.rows += len(values)
        self.missing += values.null_count
        if self.kind == "other" or not (fits_dense(values.type) or fits_sparse(values.type)):
            self.kind = "other"  # what no reader takes: counted, not profiled
            return
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        if text_ids and pa.types.is_string(values.type):
            present = values.filter(values.is_valid())
            present = present.filter(pc.greater(pc.utf8_length(present), 0))
            self.missing += len(values) - values.null_count - len(present)
            try:
                numbers = pc.cast(present, pa.float64())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                numbers = None
            if numbers is not None and self.kind == "numeric":
                self._numeric(numbers.to_numpy(zero_copy_only=False))
                self._sketch_ids(hash_ids(present))
                return
            if self.kind == "numeric":  # the first text seen: is it a list of ids in a cell?
                self.separator = _separator(present)
                self.kind = "list" if self.separator is not None else "text"
            if self.separator is not None:
                flat = pc.list_flatten(pc.split_pattern(present, self.separator))
                flat = flat.filter(pc.greater(pc.utf8_length(flat), 0))
                self._ids += len(flat)
                self._sketch_ids(hash_ids(flat))
                return
            self._sketch_ids(hash_ids(present))
            return
        if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            self.kind = "list"
            flat = pc.list_flatten(values)
            self._ids += len(flat)
            self._sketch_ids(hash_ids(flat.filter(flat.is_valid())))
            return
        present = values.filter(values.is_valid())
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            self.kind = "text"
            self._sketch_ids(hash_ids(present))
            return
        if self.kind != "numeric":  # numbers in one file, ids in another: counted as the ids
            return
        if pa.types.is_integer(values.type):
            self._sketch_ids(hash_ids(present))
        try:
            numbers = pc.cast(present, pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a half float, which pyarrow may not cast
            self.kind = "other"
            return
        self._numeric(numbers.to_numpy(zero_copy_only=False).astype(np.float64))

    def finish(self) -> None:
        """Read the sketches: the distinct ids, the mean and the median."""
        if self._sketch is not None:
            self.distinct = float(self._sketch.get_estimate())
        if self._count and self.kind == "numeric":
            self.mean = self._sum / self._count if math.isfinite(self._sum) else None
            self.median = float(self._quantiles.get_quantile(0.5))

    def _numeric(self, x: np.ndarray) -> None:
        from datasketches import kll_doubles_sketch

        if not x.size:
            return
        finite = x[np.isfinite(x)]
        if not finite.size:
            return
        self.low = float(finite.min()) if self.low is None else min(self.low, float(finite.min()))
        self.high = float(finite.max()) if self.high is None else max(self.high, float(finite.max()))
        self.integral = self.integral and bool(np.all(finite == np.round(finite)))
        self.negatives += int(np.count_nonzero(finite < 0))
        with np.errstate(over="ignore"):  # values near 1e308: the sum overflows, and the mean is left out
            self._sum += float(finite.sum())
        self._count += int(finite.size)
        if self._quantiles is None:
            self._quantiles = kll_doubles_sketch(KLL_K)
        self._quantiles.update(np.ascontiguousarray(finite, dtype=np.float64))

    def _sketch_ids(self, hashed: np.ndarray) -> None:
        from datasketches import hll_sketch

        if self._sketch is None:
            self._sketch = hll_sketch(SKETCH_LG_K)
        update = self._sketch.update
        for value in hashed.tolist():
            update(value)


def _separator(values: Any) -> str | None:
    """The separator most cells of ``values`` (text) hold, if any: they are multi-hot cells. A space must also
    give fewer distinct ids than distinct cells (genres "Comedy Romance" recombine a few words; titles or names,
    whose words are as many as the cells, are one id each)."""
    import pyarrow.compute as pc

    if not len(values):
        return None
    for candidate in SEPARATORS:
        if pc.sum(pc.match_substring(values, candidate)).as_py() <= len(values) / 2:
            continue
        if candidate != " ":
            return candidate
        words = pc.list_flatten(pc.split_pattern(values, candidate))
        if pc.count_distinct(words).as_py() < pc.count_distinct(values).as_py():
            return candidate
    return None
