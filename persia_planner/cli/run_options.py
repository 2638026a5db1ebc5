"""The options of a run that ``persia plan`` prices and ``persia train`` runs, defined once for both commands: the
model and the topology, the staleness K, the dtype PS rows and gradients travel in, and the collectives' precisions.

Each names the same value of the model (``staleness``, ``ps_wire_dtype``, ``qcomms`` in model.yaml), which it
replaces for the run (:func:`persia_planner.model.specs.with_run_options`); ``persia train`` takes the plan's when
``--plan`` gives one. Dtypes are read in one vocabulary: ours (``fp16``) or torch's (``float16``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from persia_planner.limits import MAX_STALENESS

__all__ = ["ModelOption", "PsWireOption", "QCommsOption", "StalenessOption", "TopologyOption"]

ModelOption = Annotated[
    Path | None,
    typer.Option(
        "--model",
        help="model.yaml (default: the command's bundled example: persia train's dlrm_small.yaml, persia plan's "
        "dlrm_criteo.yaml)",
    ),
]

TopologyOption = Annotated[
    Path | None,
    typer.Option(
        "--topology",
        help="topology.yaml (default: the command's bundled example: persia train's local_2x1.yaml, this machine; "
        "persia plan's cluster_2x4_2ps.yaml)",
    ),
]

StalenessOption = Annotated[
    int | None,
    typer.Option(
        "--staleness",
        min=0,
        max=MAX_STALENESS,
        help="bounded staleness K of the PS tables (default: the model's; persia train takes --plan's first; 0 is "
        "synchronous, as 'persia train --mode sync')",
    ),
]

PsWireOption = Annotated[
    str | None,
    typer.Option(
        "--ps-wire",
        help="dtype of PS rows and gradients on the wire: fp32 (exact), fp16 (|values| <= 65504) or bf16; torch's "
        "names float32, float16 and bfloat16 alike (default: the model's; persia train takes --plan's first)",
    ),
]

QCommsOption = Annotated[
    str | None,
    typer.Option(
        "--qcomms",
        help="the trainers' collectives: auto (narrow them where it pays), fp32, fp16, bf16 or FORWARD,BACKWARD "
        "(fp16,bf16) (default: the model's qcomms, else auto)",
    ),
]
