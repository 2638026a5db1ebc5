"""The CPU cases both planners are given (``benchmarks/vs_torchrec.py``): a model and a cluster of this machine each.

A case is one host of 2 or 4 trainer processes, each with an embedding-memory budget, plus parameter servers, and a
DLRM over tables whose rows, pooling and skew vary. Budgets are of three kinds (``kind``, checked by
``tests/test_vs_torchrec.py`` with :func:`budget_kind`): ``roomy`` (every table fits on one trainer), ``tight`` (not on
one trainer, but on all of them: tables must be spread, and where the largest exceeds a trainer, split) and
``ps_only`` (the tables exceed all the trainers' memory together: no all-local plan exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from persia_planner import ModelSpec, Topology
from persia_planner.paths import EXAMPLES

__all__ = [
    "KINDS",
    "PROFILE",
    "PS_ONLY",
    "QUICK_CASES",
    "ROOMY",
    "TIGHT",
    "Case",
    "budget_kind",
    "cases",
    "pick",
    "table_bytes",
]

KiB, MiB = 1024, 1024**2
PROFILE = EXAMPLES / "profiles" / "cpu-2core.yaml"

ROOMY, TIGHT, PS_ONLY = "roomy", "tight", "ps_only"
KINDS = (ROOMY, TIGHT, PS_ONLY)


@dataclass(frozen=True)
class Case:
    """One model on one CPU cluster.

    Table ``i`` of ``tables`` gets rows log-spaced from ``rows[0]`` to ``rows[1]`` and a pooling factor spaced from
    ``pooling[0]`` to ``pooling[1]``, both shuffled by ``seed`` independently, so large tables are not always the
    most pooled. All tables share ``dim`` (the DLRM ``persia train`` builds needs one) and ``zipf_alpha``.

    Attributes:
        name: Case name (``--cases`` picks by it).
        kind: The budget's intent: ``roomy``, ``tight`` or ``ps_only`` (see the module docstring).
        tables: Number of tables.
        dim: Embedding dimension of every table.
        rows: Smallest and largest table rows.
        pooling: Smallest and largest pooling factor.
        zipf_alpha: The tables' access skew, as the planner is told it.
        trainers: Trainer processes (CPU devices of the one trainer host).
        budget_kib: Each trainer's embedding memory (``cpus: memory``), KiB.
        batch: Global batch size.
        servers: Parameter-server processes.
        seed: Seed of the shuffles.
    """

    name: str
    kind: str
    tables: int
    dim: int
    rows: tuple[int, int]
    pooling: tuple[float, float]
    zipf_alpha: float
    trainers: int
    budget_kib: int
    batch: int = 2048
    servers: int = 2
    seed: int = 0

    @property
    def budget_bytes(self) -> int:
        return self.budget_kib * KiB

    def table_rows(self) -> list[int]:
        """Rows of each table, in table order."""
        rows = np.geomspace(self.rows[0], self.rows[1], self.tables).round().astype(int)
        return [int(r) for r in np.random.default_rng([self.seed, 1]).permutation(rows)]

    def table_pooling(self) -> list[float]:
        """Pooling factor of each table, in table order."""
        pooling = np.linspace(self.pooling[0], self.pooling[1], self.tables).round(1)
        return [float(p) for p in np.random.default_rng([self.seed, 2]).permutation(pooling)]

    def model_dict(self) -> dict[str, Any]:
        """model.yaml content: the tables and the DLRM ``persia train`` builds over them, K = 0."""
        tables = [
            {
                "name": f"t{i + 1}",
                "rows": rows,
                "dim": self.dim,
                "pooling_factor": pooling,
                "zipf_alpha": self.zipf_alpha,
            }
            for i, (rows, pooling) in enumerate(zip(self.table_rows(), self.table_pooling(), strict=True))
        ]
        return {
            "name": self.name,
            "batch_size": self.batch,
            "embedding_dtype": "fp32",
            "staleness": 0,  # the runs are --mode sync
            "tables": tables,
            "dense": {"arch": "dlrm", "num_dense": 13, "bottom": [64], "over": [64, 32, 1]},
        }

    def topology_dict(self, profile: Path = PROFILE) -> dict[str, Any]:
        """topology.yaml content: one host of ``trainers`` CPU trainers with ``budget`` each, and the servers."""
        hosts: list[dict[str, Any]] = [
            {
                "name": "trainer",
                "ddr": "8GiB",
                "profile": str(profile),
                "cpus": {"count": self.trainers, "memory": f"{self.budget_kib}KiB"},
            }
        ]
        if self.servers:
            hosts.append(
                {
                    "name": "ps",
                    "count": self.servers,
                    "role": "parameter_server",
                    "ddr": "2GiB",
                    "profile": str(profile),
                }
            )
        return {"name": f"{self.name}-cluster", "hosts": hosts, "network": {"latency": "50us"}}

    def write(self, folder: Path) -> tuple[Path, Path]:
        """Write model.yaml and topology.yaml into ``folder``; returns their paths."""
        folder.mkdir(parents=True, exist_ok=True)
        model, topology = folder / "model.yaml", folder / "topology.yaml"
        model.write_text(yaml.safe_dump(self.model_dict(), sort_keys=False))
        topology.write_text(yaml.safe_dump(self.topology_dict(), sort_keys=False))
        return model, topology


def cases() -> list[Case]:
    """The full benchmark's cases: 8 to 100 tables, dims 8 to 256, pooling 1 to 20, skew 0.8 to 1.3, 2 and 4
    trainers, each kind of budget (three ``ps_only``)."""
    return [
        Case("roomy-8t-d16-2tr", ROOMY, 8, 16, (500, 100_000), (1, 4), 1.05, 2, 64 * 1024),
        Case("roomy-100t-d8-2tr", ROOMY, 100, 8, (100, 20_000), (1, 1), 1.2, 2, 32 * 1024, batch=1024),
        Case("roomy-26t-d16-4tr-pool20", ROOMY, 26, 16, (100, 50_000), (1, 20), 0.9, 4, 32 * 1024),
        # Tables must be spread over the trainers (none holds them all). On CPU, TorchRec's default reservation takes
        # 15% of a rank's DDR plus 20 copies of its batch's ids, and it counts each table's pooled input and output
        # with the table: these budgets are about the least with which its planner finds a plan (28 MiB, not 24, for
        # 50 tables).
        Case("tight-12t-d32-2tr", TIGHT, 12, 32, (1_000, 120_000), (1, 10), 1.1, 2, 34 * 1024),
        Case("tight-50t-d16-4tr", TIGHT, 50, 16, (200, 80_000), (1, 6), 1.3, 4, 28 * 1024),
        # The largest table exceeds a trainer: it must be split (TorchRec splits columns of 128 or more on CPU).
        Case("tight-split-8t-d16-2tr", TIGHT, 8, 16, (1_000, 300_000), (1, 3), 1.05, 2, 21 * 1024),
        Case("tight-split-8t-d256-4tr", TIGHT, 8, 256, (500, 30_000), (1, 2), 1.05, 4, 24 * 1024, batch=1024),
        # More table bytes than all the trainers' memory: only parameter servers can hold some.
        Case("ps-26t-d16-2tr", PS_ONLY, 26, 16, (10, 200_000), (1, 3), 1.05, 2, 4 * 1024),
        Case("ps-50t-d8-4tr-zipf08", PS_ONLY, 50, 8, (100, 300_000), (1, 2), 0.8, 4, 2 * 1024),
        Case("ps-10t-d32-2tr-pool20", PS_ONLY, 10, 32, (1_000, 200_000), (5, 20), 1.2, 2, 8 * 1024),
    ]


QUICK_CASES = ("roomy-8t-d16-2tr", "tight-12t-d32-2tr", "ps-26t-d16-2tr")


def table_bytes(model: ModelSpec) -> list[int]:
    """Bytes of each table (weights and optimizer state), as the planner counts them."""
    return [t.bytes(model.dtype_of(t)) for t in model.tables]


def budget_kind(model: ModelSpec, topology: Topology) -> str:
    """Which kind of budget ``topology`` gives ``model`` (``roomy``, ``tight`` or ``ps_only``), by our memory rule.

    ``roomy``: all tables fit in one trainer's usable memory; ``tight``: not in one, but in all of them together;
    ``ps_only``: more bytes than all the trainers' raw budgets (no all-local plan, whatever the reservation).
    """
    total = sum(table_bytes(model))
    usable = [topology.hbm_capacity(g) for g in topology.gpus]
    if total > sum(g.hbm_bytes for g in topology.gpus):
        return PS_ONLY
    if total <= min(usable):
        return ROOMY
    return TIGHT if total <= sum(usable) else "between"  # "between": neither, a case to fix


def pick(names: str | None, quick: bool) -> list[Case]:
    """The cases ``--cases`` names (comma-separated), else the quick or full set.

    Raises:
        SystemExit: A name that is no case.
    """
    every = {c.name: c for c in cases()}
    wanted = names.split(",") if names else (QUICK_CASES if quick else list(every))
    unknown = [n for n in wanted if n not in every]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; the cases: {', '.join(every)}")
    return [every[n] for n in wanted]
