"""The bundled examples and the default inputs of ``persia plan`` / ``persia train`` (``persia_planner/paths.py``)."""

from __future__ import annotations

import persia_planner
from persia_planner import load_model, load_topology
from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY, EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, EXAMPLES, example


def test_examples_are_the_package_data_beside_the_package():
    from pathlib import Path

    assert Path(persia_planner.__file__).resolve().parent / "examples" == EXAMPLES
    assert example("dlrm_small.yaml") == DEFAULT_MODEL


def test_defaults_load():
    for model, topology in ((DEFAULT_MODEL, DEFAULT_TOPOLOGY), (EXAMPLE_MODEL, EXAMPLE_TOPOLOGY)):
        assert load_model(model).tables and load_topology(topology).gpus
