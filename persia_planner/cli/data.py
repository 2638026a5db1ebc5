"""``persia data profile``: a click log's rows, columns, distinct ids and missing values, and a model.yaml for it.

Reads the log once, streaming, without torch (pyarrow and DataSketches, :mod:`persia_planner.modules.data.profile`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from persia_planner.cli.app import edge, make_console, note
from persia_planner.errors import PlannerError, abbreviate, printable
from persia_planner.outputs import Output, OutputKind, check_outputs, write_output

if TYPE_CHECKING:
    from persia_planner.modules.data.profile import DataProfile

__all__ = ["data_app"]

data_app = typer.Typer(help="Look into a click log before training on it.", no_args_is_help=True)


@data_app.command("profile")
def profile_command(
    path: Annotated[
        str, typer.Argument(help="the log, as --data names it: csv:PATH, parquet:PATH or criteo:PATH (file or folder)")
    ],
    schema: Annotated[
        Path | None,
        typer.Option("--schema", help="the columns' roles (a data: mapping); default: guessed from the values"),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="write the suggested model.yaml here (default: print it)")
    ] = None,
    max_rows: Annotated[int | None, typer.Option("--max-rows", min=1, help="read at most this many rows")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of the tables")] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="replace --out if it is a model persia data profile wrote before")
    ] = False,
) -> None:
    """Profile a click log: per column its kind, missing values and distinct ids (an estimate, about 1%), the
    table rows those suggest, and a model.yaml skeleton with a table per sparse column and the dense columns'
    transforms (log1p for large non-negative values, then standardize). Files are checked as training checks them;
    at most 10,000 columns."""
    import yaml

    from persia_planner.model.data_schema import load_data_schema
    from persia_planner.modules.data.source import DataKind, DataSource
    from persia_planner.modules.train_extra import PROFILE_STACK, require_training_stack

    with edge():
        source = DataSource.parse(path)
        model_out = Output("--out", out, OutputKind.MODEL) if out is not None else None
        check_outputs([model_out], {"SCHEMA": schema, "log": source.path}, overwrite=overwrite)
        if source.kind is DataKind.SYNTHETIC:
            raise PlannerError(
                "persia data profile reads a log: synthetic data has none", fixes=("name the files: csv:PATH, ...",)
            )
        require_training_stack("persia data profile", PROFILE_STACK)
        from persia_planner.modules.data.profile import profile, suggested_rows

        found = profile(source, load_data_schema(schema) if schema is not None else None, max_rows=max_rows)
        skeleton = found.model_skeleton()
        text = yaml.safe_dump(skeleton, sort_keys=False, width=120)
        if model_out is not None:
            # The first line marks it as ours: --overwrite replaces such a file, never a model.yaml a user wrote.
            written = OutputKind.MODEL.header(f"suggested for {printable(path)}") + text
            write_output(model_out, lambda p: p.write_text(written, encoding="utf-8"), overwrite=overwrite)
        for line in _notes(found):
            note(f"note: {line}", to_stderr=True)
        if as_json:
            columns = [_column_dict(c, found, suggested_rows) for c in found.columns]
            typer.echo(json.dumps({"source": path, "rows": found.rows, "columns": columns, "model": skeleton}))
            return
        _print_profile(found, suggested_rows)
        if out is not None:
            note(f"wrote the suggested model to {printable(str(out))}", to_stderr=False)
        else:
            typer.echo("\n# a model.yaml for it" + (" (roles guessed: check them)" if found.guessed else ""))
            typer.echo(text.rstrip())


def _notes(found: DataProfile) -> list[str]:
    """What the suggested model leaves to the user: columns it cannot name, a label it could not find."""
    lines = []
    if found.left_out:
        lines.append(
            f"{len(found.left_out)} column(s) left out of the model, e.g. {abbreviate(found.left_out[0], 40)}: "
            "model.yaml cannot name a column holding a control or format character; rename them to use them"
        )
    if found.constant_dense:
        lines.append(
            f"{len(found.constant_dense)} dense column(s) hold one value in every row read, e.g. "
            f"{abbreviate(found.constant_dense[0], 40)}: suggested without standardize (it would divide by a std of 0)"
        )
    if found.label is None and found.sparse:
        lines.append("no 0/1 column to be the label: the model names LABEL_COLUMN; write the label's column there")
    return [printable(line) for line in lines]


def _column_dict(c: Any, found: Any, suggested_rows: Any) -> dict[str, Any]:
    role = found.role(c.name)
    return {
        "name": c.name,
        "kind": c.kind,
        "role": role,
        "rows": c.rows,
        "missing": c.missing,
        "distinct": None if c.distinct is None else round(c.distinct),
        "low": c.low,
        "high": c.high,
        "mean": c.mean,
        "suggested_rows": suggested_rows(c.distinct) if role == "sparse" and c.distinct else None,
    }


def _print_profile(found: Any, suggested_rows: Any) -> None:
    from rich.table import Table

    table = Table(title=printable(f"{found.source}: {found.rows:,} rows"))
    for column in ("column", "kind", "role", "missing", "distinct ids (~)", "range", "table rows"):
        table.add_column(column, justify="left" if column in ("column", "kind", "role") else "right")
    for c in found.columns:
        d = _column_dict(c, found, suggested_rows)
        spec = ",.0f" if c.integral else ",.4g"
        span = "-" if c.low is None else f"{c.low:{spec}} .. {c.high:{spec}}"
        kind = c.kind if c.separator is None else f"list ({c.separator!r})"
        missing = f"{c.missing / c.rows:.1%}" if c.rows else "-"
        distinct = "-" if d["distinct"] is None else f"{d['distinct']:,}"
        rows = "-" if d["suggested_rows"] is None else f"{d['suggested_rows']:,}"
        table.add_row(printable(c.name), kind, d["role"], missing, distinct, span, rows)
    make_console().print(table)
