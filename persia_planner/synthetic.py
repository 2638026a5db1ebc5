"""Generated models and topologies, for benchmarks, property tests and tutorials."""

from __future__ import annotations

import numpy as np

from persia_planner.model.specs import DEFAULT_STALENESS, DenseSpec, DType, ModelSpec, Optimizer, TableSpec
from persia_planner.placement.shards import even_split, server_bytes, tier_bytes
from persia_planner.tiers import Memory, local_tiers, server_tiers
from persia_planner.topology.graph import Topology

__all__ = ["heterogeneous_topology", "model_dict", "random_model", "random_topology"]


def random_model(
    n_tables: int,
    *,
    seed: int = 0,
    rows_range: tuple[float, float] = (1e3, 1e9),
    dims: tuple[int, ...] = (32, 64, 128),
    batch_size: int = 65536,
    staleness: int = DEFAULT_STALENESS,
    dtype: DType = DType.FP32,
) -> ModelSpec:
    """A model of ``n_tables`` tables: rows log-uniform in ``rows_range``, dim drawn from ``dims``, pooling factor
    log-uniform in [1, 50], Zipf alpha uniform in [0, 1.2], row-wise Adagrad; a DLRM-sized dense part."""
    rng = np.random.default_rng(seed)
    lo, hi = np.log(rows_range[0]), np.log(rows_range[1])
    rows = np.exp(rng.uniform(lo, hi, n_tables)).astype(np.int64)
    dim = rng.choice(dims, n_tables)
    pooling = np.exp(rng.uniform(0, np.log(50), n_tables))
    alpha = rng.uniform(0, 1.2, n_tables)
    tables = tuple(
        TableSpec(
            f"t{i}",
            int(max(rows[i], 1)),
            int(dim[i]),
            round(float(pooling[i]), 3),
            Optimizer.ROWWISE_ADAGRAD,
            round(float(alpha[i]), 3),
        )
        for i in range(n_tables)
    )
    dense = DenseSpec(parameters=5_000_000, flops_per_sample=30_000_000)
    return ModelSpec(f"generated-{n_tables}-s{seed}", batch_size, tables, dense, dtype, staleness)


def model_dict(model: ModelSpec) -> dict:
    """``model`` as model.yaml content (``ModelSpec.from_dict`` reads it back), e.g. to plan it with ``persia plan``."""
    return {
        "name": model.name,
        "batch_size": model.batch_size,
        "embedding_dtype": model.embedding_dtype.value,
        "staleness": model.staleness,
        "ps_wire_dtype": model.ps_wire_dtype.value,
        "tables": [
            {
                "name": t.name,
                "rows": t.rows,
                "dim": t.dim,
                "pooling_factor": t.pooling_factor,
                "optimizer": t.optimizer.value,
                "zipf_alpha": t.zipf_alpha,
                **({"embedding_dtype": t.embedding_dtype.value} if t.embedding_dtype is not None else {}),
                **({"constraints": t.constraints.to_dict()} if t.constraints.constrained else {}),
            }
            for t in model.tables
        ],
        "dense": {"parameters": model.dense.parameters, "flops_per_sample": model.dense.flops_per_sample},
    }


def random_topology(
    *, trainers: int = 8, gpus_per_trainer: int = 8, servers: int = 8, ps_ddr_bytes: int = 64 * 1024**4
) -> Topology:
    """The benchmark cluster: H100-class trainers (80 GiB HBM, 2 TiB DDR) and large-memory parameter servers."""
    return Topology.simple(
        trainers=trainers,
        gpus_per_trainer=gpus_per_trainer,
        servers=servers,
        ps_ddr_bytes=ps_ddr_bytes,
        name=f"{trainers}x{gpus_per_trainer}+{servers}ps",
    )


def heterogeneous_topology(seed: int, *, servers: int = 2) -> Topology:
    """A cluster of 2 to 4 trainer hosts that differ: each its own GPU count (1, 2, 4 or 8), HBM (16, 40 or 80 GiB per
    GPU) and NIC (12.5 to 100 GB/s); and ``servers`` parameter servers."""
    rng = np.random.default_rng(seed)
    hosts: list[dict] = []
    for i in range(int(rng.integers(2, 5))):
        hosts.append(
            {
                "name": f"h{i}_",
                "ddr": 512 * 1024**3,
                "ddr_bandwidth": "200GB/s",
                "nic_bandwidth": f"{float(rng.choice([12.5, 25.0, 50.0, 100.0])):g}GB/s",
                "gpus": {
                    "count": int(rng.choice([1, 2, 4, 8])),
                    "hbm": int(rng.choice([16, 40, 80])) * 1024**3,
                    "hbm_bandwidth": "2TB/s",
                    "tflops": 300,
                    "pcie_bandwidth": "32GB/s",
                    "nvlink_bandwidth": "300GB/s",
                },
            }
        )
    hosts += [
        {
            "name": f"ps{p}_",
            "role": "parameter_server",
            "ddr": 4 * 1024**4,
            "ddr_bandwidth": "100GB/s",
            "nic_bandwidth": "25GB/s",
        }
        for p in range(servers)
    ]
    return Topology.from_dict({"name": f"hetero-s{seed}", "hosts": hosts})


def nearly_full_topology(model: ModelSpec, fill: float, *, servers: int = 4) -> Topology:
    """:func:`random_topology` with 1 host x 1 GPU and ``servers`` parameter servers whose DDR is sized so that every
    tier together holds ``model``'s bytes times ``fill`` (1.003: HBM, DDR and PS DDR within 0.3% of full).

    Each tier charges a table what its runtime allocates (``placement.tier_bytes``): more in the servers' stores
    than locally, and a ``ddr`` table's row-wise state in HBM. The servers are sized for the tables a packing leaves
    them (greedily, the tables that would cost the stores the most per local byte first, each whole into the
    trainer's DDR with its state in HBM, or else into HBM, if it fits), plus ``fill - 1`` of all the memory.
    """
    local = random_topology(trainers=1, gpus_per_trainer=1, servers=servers)
    hbm_free = float(sum(local.hbm_capacity(g) for g in local.gpus))
    ddr_free = float(sum(local.ddr_capacity(h) for h in local.trainers))
    room = hbm_free + ddr_free
    dtype = model.dtype_of
    in_stores = [
        float(
            server_bytes(t, server_tiers()[0], np.array(even_split(t.rows, servers)), t.dim, dtype(t))[
                Memory.SERVER
            ].sum()
        )
        for t in model.tables
    ]
    # the uncached tier of rows in the trainer's DDR (``ddr``)
    in_host_memory = next(t for t in local_tiers() if t.spec.rows_in is Memory.HOST and not t.spec.cached)
    order = np.argsort([-b / t.bytes(dtype(t)) for t, b in zip(model.tables, in_stores, strict=True)], kind="stable")
    need = 0.0
    for i in order:
        table = model.tables[i]
        state, rows = (float(b) for b in tier_bytes(table, in_host_memory, table.rows, table.dim, dtype(table)))
        if rows <= ddr_free and state <= hbm_free:
            ddr_free, hbm_free = ddr_free - rows, hbm_free - state
        elif table.bytes(dtype(table)) <= hbm_free:
            hbm_free -= table.bytes(dtype(table))
        else:
            need += in_stores[i]
    ps_usable = 1 - local.constants.ps_reserve_fraction
    ps_ddr = int((need + (fill - 1) * (room + need)) / servers / ps_usable)
    return random_topology(trainers=1, gpus_per_trainer=1, servers=servers, ps_ddr_bytes=ps_ddr)
