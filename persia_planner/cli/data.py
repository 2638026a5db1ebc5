"""``persia data profile``: a click log's rows, columns, distinct ids and missing values, and a model.yaml for it.

Reads the log once, streaming, without torch (pyarrow and DataSketches, :mod:`persia_planner.modules.data.profile`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from persia_planner.cli.app import edge, make_console, note
from persia_planner.errors import PlannerError, printable
from persia_planner.outputs import Output, OutputKind, check_outputs, write_output

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
    collision_rate: Annotated[
        float,
        typer.Option(
            "--collision-rate",
            help="the share of a table's ids that may share their row with another id: sizes the tables (0.01: "
            "about 100 rows per id)",
        ),
    ] = 0.01,
    delimiter: Annotated[
        str | None,
        typer.Option("--delimiter", help="a CSV's delimiter: ',', tab ('\\t'), '|' or ';' (default: found)"),
    ] = None,
) -> None:
    """Profile a click log: per column its kind, missing values and distinct ids (an estimate, about 1%), the role
    guessed for it and why, and a model.yaml that persia train reads without edits: a table per id column sized for
    --collision-rate, the dense columns' transforms (log1p for heavy-tailed counts, then standardize), a batch size
    of at least 50 steps an epoch, and the columns left out (unique per row, constant) in notes. A CSV's delimiter
    is found from its first lines. Files are checked as training checks them; at most 10,000 columns."""
    import yaml

    from persia_planner.model.data_schema import CSV_DELIMITERS, load_data_schema
    from persia_planner.modules.data.source import DataKind, DataSource
    from persia_planner.modules.train_extra import PROFILE_STACK, require_training_stack

    with edge():
        if not 0 < collision_rate < 1:  # nan fails this too
            raise PlannerError(
                f"--collision-rate must be in (0, 1), got {collision_rate}", fixes=("e.g. --collision-rate 0.01",)
            )
        delimiter = "\t" if delimiter in ("\\t", "tab") else delimiter
        if delimiter is not None and delimiter not in CSV_DELIMITERS:
            raise PlannerError(
                f"--delimiter must be one of ',', '\\t' (tab), '|', ';', got {delimiter!r}",
                fixes=("leave it out: it is found from the file's first lines",),
            )
        source = DataSource.parse(path)
        model_out = Output("--out", out, OutputKind.MODEL) if out is not None else None
        check_outputs([model_out], {"SCHEMA": schema, "log": source.path}, overwrite=overwrite)
        if source.kind is DataKind.SYNTHETIC:
            raise PlannerError(
                "persia data profile reads a log: synthetic data has none", fixes=("name the files: csv:PATH, ...",)
            )
        require_training_stack("persia data profile", PROFILE_STACK)
        from persia_planner.modules.data.profile import profile, suggested_rows

        schema_given = load_data_schema(schema) if schema is not None else None
        found = profile(source, schema_given, max_rows=max_rows, delimiter=delimiter)
        skeleton = found.model_skeleton(collision_rate=collision_rate)
        text = yaml.safe_dump(skeleton, sort_keys=False, width=120, default_flow_style=None)
        notes = found.notes()
        if model_out is not None:
            # The first line marks it as ours: --overwrite replaces such a file, never a model.yaml a user wrote.
            comments = "".join(f"# note: {line}\n" for line in notes)
            written = OutputKind.MODEL.header(f"suggested for {printable(path)}") + comments + text
            write_output(model_out, lambda p: p.write_text(written, encoding="utf-8"), overwrite=overwrite)
        for line in notes:
            note(f"note: {line}", to_stderr=True)
        if as_json:
            columns = [_column_dict(c, found, suggested_rows, collision_rate) for c in found.columns]
            typer.echo(
                json.dumps({"source": path, "rows": found.rows, "columns": columns, "notes": notes, "model": skeleton})
            )
            return
        _print_profile(found, suggested_rows, collision_rate)
        if out is not None:
            note(f"wrote the suggested model to {printable(str(out))}", to_stderr=False)
        else:
            typer.echo("\n# a model.yaml for it" + (" (roles guessed: check them)" if found.guessed else ""))
            typer.echo(text.rstrip())


def _column_dict(c: Any, found: Any, suggested_rows: Any, collision_rate: float) -> dict[str, Any]:
    role = found.role(c.name)
    return {
        "name": c.name,
        "kind": c.kind,
        "role": role,
        "why": found.why(c.name),
        "rows": c.rows,
        "missing": c.missing,
        "distinct": None if c.distinct is None else round(c.distinct),
        "low": c.low,
        "high": c.high,
        "mean": c.mean,
        "median": c.median,
        "suggested_rows": suggested_rows(c.distinct, collision_rate) if role == "sparse" and c.distinct else None,
    }


def _print_profile(found: Any, suggested_rows: Any, collision_rate: float) -> None:
    from rich.table import Table

    from persia_planner.modules.data.delimiters import described_delimiter

    split = "" if found.delimiter is None else f", fields separated by {described_delimiter(found.delimiter)}"
    table = Table(title=printable(f"{found.source}: {found.rows:,} rows{split}"))
    for column in ("column", "kind", "role", "why", "missing", "distinct ids (~)", "range", "table rows"):
        table.add_column(column, justify="left" if column in ("column", "kind", "role", "why") else "right")
    for c in found.columns:
        d = _column_dict(c, found, suggested_rows, collision_rate)
        spec = ",.0f" if c.integral else ",.4g"
        span = "-" if c.low is None else f"{c.low:{spec}} .. {c.high:{spec}}"
        kind = c.kind if c.separator is None else f"list ({c.separator!r})"
        missing = f"{c.missing / c.rows:.1%}" if c.rows else "-"
        distinct = "-" if d["distinct"] is None else f"{d['distinct']:,}"
        rows = "-" if d["suggested_rows"] is None else f"{d['suggested_rows']:,}"
        table.add_row(printable(c.name), kind, d["role"], printable(d["why"]), missing, distinct, span, rows)
    make_console().print(table)
