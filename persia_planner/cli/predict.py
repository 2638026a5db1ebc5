"""``persia predict``: score the rows of a click log with a training checkpoint.

The checkpoint and the data are checked before torch is imported; the engine is
:mod:`persia_planner.modules.train.prediction`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from persia_planner.cli.app import edge, note

__all__ = ["predict_command"]


def predict_command(
    checkpoint: Annotated[
        Path,
        typer.Option(
            "--checkpoint", help="persia train's --checkpoint directory (its newest whole checkpoint) or a step-* one"
        ),
    ],
    data: Annotated[
        str,
        typer.Option(
            "--data", help="the rows to score, as persia train's --data names them: csv:PATH, parquet:PATH, criteo:PATH"
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", help="the scores, a Parquet file: row, score (and label where the rows have it)")
    ],
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="rows per forward pass")] = 8192,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace --out if it exists")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of text")] = False,
) -> None:
    """Score every row of --data with the model of a persia train checkpoint: the columns transformed as the run
    transformed its own (the statistics it measured), the tables on the parameter servers served by as many servers
    as the run had, in file order into one Parquet file."""
    from persia_planner.modules.train_extra import require_training_stack

    with edge():
        require_training_stack("persia predict")
        from persia_planner.modules.train.prediction import describe, predict

        result = predict(checkpoint, data, out, batch_size=batch_size, overwrite=overwrite)
        if as_json:
            typer.echo(json.dumps(result.to_dict()))
        else:
            note(describe(result), to_stderr=False)
