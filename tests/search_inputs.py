"""Small real inputs of the search stages' tests (tests/test_search_*.py): clusters, models, and a
:class:`persia_planner.search.state.State` built as construction builds it, empty or with tables forced onto devices.

Every vector comes from the real cost model: a forced table's load and memory vectors are the cost model's of its
placement (:meth:`persia_planner.cost.analytic.CostModel.placement_loads`), the same vectors the search adds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from persia_planner import ModelSpec, SearchConfig, Topology
from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.search.base import Choice, Option
from persia_planner.search.options import TieredOptions
from persia_planner.search.result import build_placement
from persia_planner.search.shards import ShardTerms
from persia_planner.search.state import State
from persia_planner.tiers import Tier

GIB = 2**30
# Bytes a row of dim 64 takes in fp32 with the default optimizer (rowwise Adagrad: one float of state per row).
ROW_BYTES_64 = 260


def cluster(
    trainers: int = 1,
    gpus: int = 2,
    servers: int = 0,
    *,
    hbm: str = "16GiB",
    ddr: str = "64GiB",
    ps_ddr: str = "256GiB",
    ssd: str | None = None,
) -> Topology:
    """``trainers`` hosts of ``gpus`` GPUs each, and ``servers`` parameter servers (each with a disk of ``ssd``)."""
    gpu = {"count": gpus, "hbm": hbm, "hbm_bandwidth": "2TB/s", "tflops": 300, "pcie_bandwidth": "32GB/s"}
    hosts: list[dict] = [
        {"name": "trainer", "count": trainers, "ddr": ddr, "ddr_bandwidth": "200GB/s", "nic_bandwidth": "25GB/s"}
        | {"gpus": gpu | {"nvlink_bandwidth": "300GB/s"}}
    ]
    if servers:
        server = {"name": "ps", "count": servers, "role": "parameter_server", "ddr": ps_ddr}
        hosts.append(server | {"ddr_bandwidth": "100GB/s", "nic_bandwidth": "25GB/s"} | ({"ssd": ssd} if ssd else {}))
    return Topology.from_dict({"name": f"{trainers}x{gpus}+{servers}", "hosts": hosts})


def model(*tables: Mapping, batch_size: int = 4096) -> ModelSpec:
    """A model of ``tables`` (model.yaml's table entries: name, rows, dim, pooling_factor, ...)."""
    return ModelSpec.from_dict({"name": "m", "batch_size": batch_size, "tables": [dict(t) for t in tables]})


def table(name: str, rows: int, dim: int = 64, pooling: float = 4.0, **more: object) -> dict:
    """One table entry of model.yaml."""
    return {"name": name, "rows": rows, "dim": dim, "pooling_factor": pooling, **more}


def state(cost: CostModel, config: SearchConfig | None = None) -> State:
    """An empty state with the default enumeration, as :class:`persia_planner.search.construct.GreedyConstruction`
    builds one (no memory prices)."""
    return State(cost, config or SearchConfig(), TieredOptions(), None, ShardTerms(cost))


def forced_choice(cost: CostModel, name: str, option: Option, gpus: Sequence[int]) -> Choice:
    """Table ``name`` placed by ``option`` on ``gpus``, with the cost model's vectors of that placement."""
    spec = next(t for t in cost.model.tables if t.name == name)
    loads, mem = cost.placement_loads(spec, build_placement(cost, spec, option, gpus))
    return Choice(option, tuple(gpus), loads, mem)


def all_on_one_gpu(cost: CostModel, config: SearchConfig | None = None, gpu: int = 0) -> State:
    """A valid but bad start: every table table-wise in the HBM of GPU ``gpu``, the others idle."""
    result = state(cost, config)
    for spec in cost.model.tables:
        result.add(spec.name, forced_choice(cost, spec.name, Option(Sharding.TABLE_WISE, Tier.HBM), (gpu,)))
    return result


def within_capacity(s: State) -> bool:
    """Whether the state's memory is within its capacities (validation allows half a byte over)."""
    return bool((s.mem <= s.cap + 0.5).all())


def sums_match_choices(s: State) -> bool:
    """Whether the state's load and memory sums are those of its choices (a move added or removed one twice, else)."""
    loads = s.cost.fixed_loads() + sum((c.loads for c in s.choices.values()), np.zeros_like(s.loads))
    mem = s.cost.memory_vector() + sum((c.mem for c in s.choices.values()), np.zeros_like(s.mem))
    return bool(np.allclose(s.loads, loads, rtol=1e-9, atol=1e-9) and np.allclose(s.mem, mem, rtol=0, atol=1.0))


def snapshot(s: State) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[Option, tuple[int, ...]]]]:
    """The state's sums and each table's option and devices, copied."""
    return s.loads.copy(), s.mem.copy(), {n: (c.option, c.gpus) for n, c in s.choices.items()}
