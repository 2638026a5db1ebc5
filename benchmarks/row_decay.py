"""What ``--sparse-weight-decay`` costs a step of the local tables: the fused tables' forward and backward (fbgemm,
sharded by DMP on one trainer) with and without the decay of the rows each step touches
(:mod:`persia_planner.modules.embedding.row_decay`), and the servers' row optimizer step with and without it.

The two settings alternate in blocks, on one thread, so that a busy machine slows both alike; the medians of each
setting's steps are compared.

    python benchmarks/row_decay.py [--rows 100000] [--tables 8] [--batch 1024] [--steps 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.kinds import Sharding
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.model_parallel import distribute
from persia_planner.modules.ps import optim as ps_optim
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology

DECAY = 1e-3
_TOPOLOGY = {
    "name": "1x1",
    "hosts": [
        {
            "name": "trainer",
            "count": 1,
            "ddr": "64GiB",
            "ddr_bandwidth": "200GB/s",
            "nic_bandwidth": "50GB/s",
            "gpus": {"count": 1, "hbm": "16GiB", "hbm_bandwidth": "2TB/s", "tflops": 100, "pcie_bandwidth": "32GB/s"},
        }
    ],
}


def _collection(rows: int, tables: int, dim: int, decay: float) -> tuple[torch.nn.Module, list[str]]:
    configs = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=rows, embedding_dim=dim)
        for i in range(tables)
    ]
    plan = {
        c.name: TablePlacement(Sharding.TABLE_WISE, (Shard("trainer0/gpu0", Tier.HBM, (0, dim), 0, rows=(0, rows)),))
        for c in configs
    }
    sparse = SparseOptimizer(learning_rate=0.05, weight_decay=decay)
    hybrid = HybridEmbeddingBagCollection(configs, plan, optimizer=sparse, local_device=torch.device("meta"))
    return distribute(hybrid, plan, Topology.from_dict(_TOPOLOGY)), [f"f{i}" for i in range(tables)]


def _batch(gen: torch.Generator, keys: list[str], batch: int, rows: int) -> KeyedJaggedTensor:
    lengths = torch.randint(1, 4, (len(keys) * batch,), generator=gen)
    # Zipf-like ids, as click logs have: a few hot rows, a long tail
    values = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * rows).long()
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def local_step_ms(rows: int, tables: int, dim: int, batch: int, steps: int, block: int = 10) -> dict[str, float]:
    """Median ms of a fused tables' forward and backward, without and with the decay, in alternating blocks."""
    nets = {0.0: _collection(rows, tables, dim, 0.0), DECAY: _collection(rows, tables, dim, DECAY)}
    gen = torch.Generator().manual_seed(0)
    times: dict[float, list[float]] = {0.0: [], DECAY: []}
    for start in range(0, steps, block):
        for decay, (net, keys) in nets.items():
            for _ in range(min(block, steps - start)):
                kjt = _batch(gen, keys, batch, rows)
                began = time.perf_counter()
                net(kjt).values().square().mean().backward()
                times[decay].append((time.perf_counter() - began) * 1e3)
    return {"without_ms": statistics.median(times[0.0]), "with_ms": statistics.median(times[DECAY])}


def server_step_ms(distinct: int, dim: int, repeats: int = 200) -> dict[str, float]:
    """Median ms of the servers' row-wise Adagrad step over ``distinct`` gathered rows, without and with the decay."""
    weights, grads = torch.randn(distinct, dim), torch.randn(distinct, dim)
    state = torch.zeros(distinct, 1)
    out = {}
    for name, opt in (
        ("without_ms", ps_optim.RowWiseAdagrad(lr=0.05)),
        ("with_ms", ps_optim.RowWiseAdagrad(lr=0.05, decoupled_weight_decay=DECAY)),
    ):
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            opt.step(weights, state, grads)
            times.append((time.perf_counter() - began) * 1e3)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the results there")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        local = local_step_ms(args.rows, args.tables, args.dim, args.batch, args.steps)
    finally:
        dist.destroy_process_group()
    server = server_step_ms(args.batch * 2, args.dim)
    result: dict[str, Any] = {"settings": vars(args) | {"decay": DECAY}, "local": local, "server": server}
    for part in (local, server):
        part["overhead"] = part["with_ms"] / part["without_ms"] - 1
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
