"""Where the bundled examples are, and the files ``persia plan`` and ``persia train`` take when given none.

The one place for these paths: ``persia_planner/examples/`` is package data beside this module in the source tree and
when installed alike.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_MODEL", "DEFAULT_TOPOLOGY", "EXAMPLES", "EXAMPLE_MODEL", "EXAMPLE_TOPOLOGY", "example"]

EXAMPLES = Path(__file__).resolve().parent / "examples"
"""The bundled model.yaml / topology.yaml examples (and ``profiles/``)."""


def example(name: str) -> Path:
    """The bundled example file ``name`` (e.g. ``"dlrm_small.yaml"``)."""
    return EXAMPLES / name


EXAMPLE_MODEL = example("dlrm_criteo.yaml")
"""What ``persia plan`` plans when given neither MODEL nor TOPOLOGY."""
EXAMPLE_TOPOLOGY = example("cluster_2x4_2ps.yaml")
DEFAULT_MODEL = example("dlrm_small.yaml")
"""What ``persia train`` trains when given no ``--model`` (and the tutorials' and tests' small DLRM)."""
DEFAULT_TOPOLOGY = example("local_2x1.yaml")
"""The topology ``persia train`` plans for when given no ``--topology``: two CPU trainers on this machine."""
