"""The input reader (``persia_planner.fields``) under fuzzing: whatever a model.yaml, topology.yaml or plan.json holds,
the loaders answer with the planner's own typed errors (one line, naming the file), never another exception."""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persia_planner import load_model, load_plan, load_topology, plan
from persia_planner.errors import MAX_LINE_CHARS, PlannerError
from persia_planner.paths import EXAMPLE_MODEL, EXAMPLE_TOPOLOGY, EXAMPLES

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))
MODELS = [p for p in EXAMPLE_FILES if "tables" in yaml.safe_load(p.read_text())]
TOPOLOGIES = [p for p in EXAMPLE_FILES if p not in MODELS and "hosts" in yaml.safe_load(p.read_text())]

# Keys the three formats know, so that generated mappings reach past the first "unknown key".
KEYS = sorted(
    {
        *("name", "batch_size", "embedding_dtype", "staleness", "tables", "rows", "dim", "pooling_factor"),
        *("optimizer", "zipf_alpha", "count", "dense", "parameters", "flops_per_sample", "hosts", "ddr"),
        *("ddr_bandwidth", "nic_bandwidth", "gpus", "cpus", "hbm", "hbm_bandwidth", "tflops", "pcie_bandwidth"),
        *("nvlink_bandwidth", "role", "network", "bandwidth", "latency", "nodes", "links", "kind", "a", "b"),
        *("constants", "memory", "link_bandwidth", "format", "model", "topology", "devices", "estimate"),
        *("sharding", "mode", "shards", "tier", "device", "cols", "hash", "bytes", "cache_fraction", "replica"),
        *("step_ms", "lower_bound_ms", "samples_per_s", "hbm_bytes", "ddr_bytes", "cost_ms", "persia-plan/1"),
        *("profile", "cache_fractions", "hbm_efficiency", "id_bytes", "ps_reserve_fraction", "c1_user"),
    }
)
WORDS = [
    *("1e300", "-1e300", "1e999999999", "nan", "inf", "-0", "0", "1", "4M", "80GiB", "1.5TB", "400Gbps", "5us"),
    *("5Ms", "25GB", "64GB/s", "persia-plan/1", "trainer0/gpu0", "ps0", "hbm", "ddr", "ps", "hbm_cache"),
    *("table_wise", "row_wise", "column_wise", "ps_hash", "data_parallel", "sync", "async", "fp16", "adam"),
    *("parameter_server", "trainer", "gpu", "host", "switch", "..", "/", "a/b", "\0", "", " ", "x" * 300),
]

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(WORDS)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def example_plan() -> dict[str, Any]:
    model, topology = load_model(EXAMPLE_MODEL), load_topology(EXAMPLE_TOPOLOGY)
    return plan(model, topology, seed=0, explain_top=0).to_dict()


def _only_typed_errors(load: Callable[[Path], Any], path: Path) -> None:
    """``load(path)`` succeeds or raises a PlannerError whose message is one line naming the file."""
    try:
        load(path)
    except PlannerError as err:
        line = str(err)
        assert "\n" not in line and len(line) <= MAX_LINE_CHARS, line
        assert path.name in line, line


def _mutate(data: Any, draw: Callable[[Any], Any]) -> Any:
    """``data`` with one node (picked along a random path) replaced, deleted, or given a new key or item."""
    data = copy.deepcopy(data)
    if not isinstance(data, dict | list) or not data:
        return draw(VALUES)
    node = data
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, dict | list) and child and draw(st.booleans()):
            node = child
            continue
        action = draw(st.sampled_from(["replace", "delete", "add", "duplicate"]))
        if action == "replace":
            node[key] = draw(VALUES)
        elif action == "delete":
            del node[key]
        elif action == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(KEYS))] = draw(VALUES)
        elif isinstance(node, list):
            node.extend([child] * draw(st.integers(1, 3)))
        else:
            node[key] = [child, child]
        return data


def _write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, allow_unicode=True, default_flow_style=None))
    return path


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, allow_nan=True))
    return path


def _text_mutation(text: str, draw: Callable[[Any], Any]) -> str:
    """``text`` cut, or with a few characters inserted or removed at one place: broken syntax and odd values."""
    at = draw(st.integers(0, len(text)))
    kind = draw(st.sampled_from(["cut", "insert", "remove"]))
    if kind == "cut":
        return text[:at]
    if kind == "insert":
        return text[:at] + draw(st.sampled_from(["[", "{", "]", "}", ":", "- ", "\n", "'", '"', "&a ", "*a", "9" * 30]))
    return text[: max(at - draw(st.integers(1, 8)), 0)] + text[at:]


LOADERS = {"model": load_model, "topology": load_topology, "plan": load_plan}

# 2,000 examples in all (a few hundred ms each at most): random documents, mutated examples, mutated text.
FUZZ = settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), data=VALUES)
def test_random_documents_give_only_typed_errors(workdir, kind, data):
    path = workdir / f"random_{kind}.{'json' if kind == 'plan' else 'yaml'}"
    (_write_json if kind == "plan" else _write_yaml)(path, data)
    _only_typed_errors(LOADERS[kind], path)


@FUZZ
@given(example=st.sampled_from(MODELS), draw=st.data())
def test_mutated_models_give_only_typed_errors(workdir, example, draw):
    data = _mutate(yaml.safe_load(example.read_text()), draw.draw)
    _only_typed_errors(load_model, _write_yaml(workdir / "model.yaml", data))


@FUZZ
@given(example=st.sampled_from(TOPOLOGIES), draw=st.data())
def test_mutated_topologies_give_only_typed_errors(workdir, example, draw):
    data = _mutate(yaml.safe_load(example.read_text()), draw.draw)
    _only_typed_errors(load_topology, _write_yaml(workdir / "topology.yaml", data))


@FUZZ
@given(draw=st.data())
def test_mutated_plans_give_only_typed_errors(workdir, example_plan, draw):
    data = _mutate(example_plan, draw.draw)
    _only_typed_errors(load_plan, _write_json(workdir / "plan.json", data))


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), draw=st.data())
def test_mutated_text_gives_only_typed_errors(workdir, example_plan, kind, draw):
    if kind == "plan":
        text, name = json.dumps(example_plan, indent=1), "plan.json"
    else:
        text, name = (EXAMPLE_MODEL if kind == "model" else EXAMPLE_TOPOLOGY).read_text(), f"{kind}.yaml"
    path = workdir / name
    path.write_text(_text_mutation(text, draw.draw))
    _only_typed_errors(LOADERS[kind], path)


def test_the_fuzzed_examples_exist():
    assert MODELS and TOPOLOGIES
