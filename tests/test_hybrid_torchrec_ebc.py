"""TorchRec's own ``EmbeddingBagCollectionTest`` cases, run against :class:`HybridEmbeddingBagCollection`.

Adapted from ``torchrec/modules/tests/test_embedding_modules.py`` (pytorch/torchrec, class
``EmbeddingBagCollectionTest``; Copyright (c) Meta Platforms, Inc. and affiliates, BSD 3-Clause licence, whose
notice is kept in TorchRec's repository). The cases are those nine, each rewritten here against the drop-in, with
every table local and one process (no plan: the collection is then a TorchRec ``EmbeddingBagCollection`` of its own).
Where the drop-in must differ, the case says why in one line.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.fx
from torchrec.fx import symbolic_trace
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection


def _two_by_three() -> KeyedJaggedTensor:
    #     0       1        2  <-- batch
    # 0   [0,1] None    [2]
    # 1   [3]    [4]    [5,6,7]
    return KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8])
    )


def _weighted(device: str = "cpu") -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f3", "f2"],
        values=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7], device=device),
        offsets=torch.tensor([0, 2, 4, 6, 8, 10, 12], device=device),
        weights=torch.tensor([0.1, 0.2, 0.4, 0.5, 0.4, 0.3, 0.2, 0.9, 0.1, 0.3, 0.4, 0.7], device=device),
    )


def _weighted_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f3"]),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"]),
    ]


def test_unweighted():
    eb1 = EmbeddingBagConfig(
        name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"],
        init_fn=partial(torch.nn.init.normal_, mean=0.0, std=1.5),
    )  # fmt: skip
    eb2 = EmbeddingBagConfig(
        name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"],
        init_fn=partial(torch.nn.init.uniform_, a=-0.036, b=0.036),
    )  # fmt: skip
    ebc = HybridEmbeddingBagCollection([eb1, eb2])
    pooled = ebc(_two_by_three())
    assert pooled.values().size() == (3, 7)
    assert pooled.keys() == ["f1", "f2"]
    assert pooled.offset_per_key() == [0, 3, 7]


def test_shared_tables():
    config = EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f2"])
    pooled = HybridEmbeddingBagCollection([config])(_two_by_three())
    assert pooled.values().size() == (3, 6)
    assert pooled.keys() == ["f1", "f2"]
    assert pooled.offset_per_key() == [0, 3, 6]


def test_shared_features():
    eb1 = EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"])
    eb2 = EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f1"])
    features = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8])
    )
    pooled = HybridEmbeddingBagCollection([eb1, eb2])(features)
    assert pooled.values().size() == (6, 7)
    assert pooled.keys() == ["f1@t1", "f1@t2"]
    assert pooled.offset_per_key() == [0, 3, 7]


def test_weighted():
    ebc = HybridEmbeddingBagCollection(_weighted_configs(), is_weighted=True)
    pooled = ebc(_weighted())
    assert pooled.values().size() == (2, 10)
    assert pooled.keys() == ["f1", "f3", "f2"]
    assert pooled.offset_per_key() == [0, 3, 6, 10]


def test_forward_with_meta_device():
    ebc = HybridEmbeddingBagCollection(_weighted_configs(), is_weighted=True, device=torch.device("meta"))
    pooled = ebc(_weighted("meta"))
    assert pooled.values().size() == (2, 10)
    assert pooled.keys() == ["f1", "f3", "f2"]
    assert pooled.offset_per_key() == [0, 3, 6, 10]
    assert pooled.values().device == torch.device("meta")


def test_fx():
    ebc = HybridEmbeddingBagCollection(_weighted_configs(), is_weighted=True)
    gm = symbolic_trace(ebc)
    torch.jit.script(gm)
    pooled = gm(_weighted())
    assert pooled.values().size() == (2, 10)
    assert pooled.keys() == ["f1", "f3", "f2"]
    assert pooled.offset_per_key() == [0, 3, 6, 10]
    # ... and the traced module computes what the module does.
    assert torch.equal(pooled.values(), ebc(_weighted()).values())


def test_scripting():
    config = EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"])
    torch.jit.script(HybridEmbeddingBagCollection([config]))


def test_duplicate_config_name_fails():
    eb1 = EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"])
    eb2 = EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f2"])
    with pytest.raises(ValueError):
        HybridEmbeddingBagCollection([eb1, eb2])


def test_device():
    config = EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"])
    # test with device from input
    ebc = HybridEmbeddingBagCollection([config], device=torch.device("meta"))
    assert ebc.embedding_bags["t1"].weight.device == torch.device("meta")
    assert ebc.device == torch.device("meta")
    # test with device from context manager
    with torch.device("meta"):
        ebc = HybridEmbeddingBagCollection([config])
    assert ebc.embedding_bags["t1"].weight.device == torch.device("meta")
    assert ebc.device == torch.device("meta")
    # test default device is cpu
    ebc = HybridEmbeddingBagCollection([config])
    assert ebc.embedding_bags["t1"].weight.device == torch.device("cpu")
    assert ebc.device == torch.device("cpu")


# ---- beyond TorchRec's cases: what a TorchRec user's own script touches --------------------------------------------


def test_state_dict_keys_are_torchrec_s_and_a_torchrec_checkpoint_loads_both_ways():
    configs = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=8, feature_names=["f2"]),
    ]
    ebc = EmbeddingBagCollection(tables=configs)
    hybrid = HybridEmbeddingBagCollection(configs)
    assert (
        list(hybrid.state_dict()) == list(ebc.state_dict()) == ["embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    )
    hybrid.load_state_dict(ebc.state_dict())
    assert torch.equal(hybrid(_two_by_three()).values(), ebc(_two_by_three()).values())
    with torch.no_grad():
        hybrid.embedding_bags["t2"].weight.add_(1.0)
    ebc.load_state_dict(hybrid.state_dict())
    assert torch.equal(hybrid(_two_by_three()).values(), ebc(_two_by_three()).values())
    assert [c.name for c in hybrid.embedding_bag_configs()] == ["t1", "t2"] and not hybrid.is_weighted()
    before = hybrid.embedding_bags["t1"].weight.detach().clone()
    hybrid.reset_parameters()
    after = hybrid.embedding_bags["t1"].weight
    assert not torch.equal(before, after) and float(after.abs().max()) <= (1 / 10) ** 0.5


def _ps_round_trip(rank: int, client) -> dict:
    """One trainer, two servers: a TorchRec collection's state loads into the drop-in, PS table included, and the
    drop-in's trained state loads back into TorchRec's."""
    from plans import TOPO_1X2, local_placement, ps_placement

    from persia_planner.model.specs import Optimizer
    from persia_planner.modules.embedding.hybrid import SparseOptimizer
    from persia_planner.topology.graph import Topology

    configs = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=8, feature_names=["f2"]),
    ]
    assert Topology.from_dict(TOPO_1X2)
    plan = {"t1": ps_placement(4, servers=2), "t2": local_placement(8, 8)}
    sgd = SparseOptimizer(Optimizer.SGD, learning_rate=0.5)
    hybrid = HybridEmbeddingBagCollection(configs, plan, ps=client, optimizer=sgd)
    ebc = EmbeddingBagCollection(tables=configs)
    out: dict = {"keys": list(hybrid.state_dict())}
    fresh = hybrid.state_dict()["embedding_bags.t1.weight"]
    out["fresh_in_range"] = bool(fresh.abs().max() <= (1 / 10) ** 0.5) and bool(fresh.abs().sum() > 0)
    hybrid.load_state_dict(ebc.state_dict())
    hybrid.eval()  # a training forward would wait for its backward before the next one
    out["loaded_equal"] = torch.equal(hybrid(_two_by_three()).values(), ebc(_two_by_three()).values())
    hybrid.train()
    hybrid(_two_by_three()).values().sum().backward()
    hybrid.flush()
    with torch.no_grad():
        hybrid.embedding_bags["t2"].weight.add_(1.0)  # the local table moves too
    trained = hybrid.state_dict()
    out["moved"] = float(
        (trained["embedding_bags.t1.weight"] - ebc.state_dict()["embedding_bags.t1.weight"]).abs().max()
    )
    ebc.load_state_dict(trained)
    hybrid.eval()
    out["back_equal"] = torch.equal(hybrid(_two_by_three()).values(), ebc(_two_by_three()).values())
    with hybrid.ps_rows_left_out():
        out["left_out"] = list(hybrid.state_dict())
    # Traced as TorchRec's train pipeline traces it: the PS tables one call of their (leaf) module.
    from torchrec.fx import Tracer

    graph = Tracer(leaf_modules=["RemoteEmbeddingBags"]).trace(hybrid)
    traced = torch.fx.GraphModule(hybrid, graph)
    calls = [n.target for n in graph.nodes if n.op == "call_module"]
    out["traced_equal"] = torch.equal(traced(_two_by_three()).values(), hybrid(_two_by_three()).values())
    out["traced_calls"] = [c for c in calls if "remote" in c]
    return out


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_torchrec_checkpoint_loads_into_the_servers_tables_and_back():
    from persia_planner.modules.train import run_trainers

    (result,) = run_trainers(_ps_round_trip, trainers=1, servers=2)
    assert result["keys"] == ["embedding_bags.t1.weight", "embedding_bags.t2.weight"]  # TorchRec's, in config order
    assert result["fresh_in_range"]  # rows never trained read as their initial values
    assert result["loaded_equal"] and result["back_equal"] and result["moved"] > 1e-3
    assert result["left_out"] == ["embedding_bags.t2.weight"]
    assert result["traced_equal"] and result["traced_calls"] == ["remote"]
