"""Reading TorchRec's collections (persia_planner/model/torchrec_configs.py): bags and sequences, alone or in one
model, on the meta device."""

import pytest

from persia_planner import ModelSpec, SpecError
from persia_planner.model.pooling import Pooling

torchrec = pytest.importorskip("torchrec")
torch = pytest.importorskip("torch")

from torchrec.distributed.planner.types import ParameterConstraints  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402

META = torch.device("meta")


def _ec():
    configs = [
        EmbeddingConfig(name="hist", embedding_dim=16, num_embeddings=1000, feature_names=["hist"]),
        EmbeddingConfig(name="cand", embedding_dim=16, num_embeddings=500, feature_names=["cand"]),
    ]
    return configs, torchrec.EmbeddingCollection(tables=configs, device=META)


def test_an_embedding_collection_gives_sequence_tables():
    configs, ec = _ec()
    for source in (configs, ec):
        m = ModelSpec.from_torchrec(source, 64, pooling_factors={"hist": 20.0}, max_sequence_lengths={"hist": 50})
        hist, cand = m.tables
        assert (hist.name, hist.rows, hist.dim, hist.pooling) == ("hist", 1000, 16, Pooling.NONE)
        assert (hist.pooling_factor, hist.max_sequence_length) == (20.0, 50)
        assert cand.sequence and cand.pooling_factor == 1.0 and cand.max_sequence_length is None


def test_a_model_holding_bags_and_sequences_gives_every_table_in_module_order():
    _, ec = _ec()
    bags = [
        EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=10, feature_names=["user"]),
        EmbeddingBagConfig(
            name="tags", embedding_dim=8, num_embeddings=10, feature_names=["tags"], pooling=PoolingType.MEAN
        ),
    ]
    model = torch.nn.Module()
    model.ebc = torchrec.EmbeddingBagCollection(tables=bags, device=META)
    model.tower = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.ec = ec
    m = ModelSpec.from_torchrec(model, 64)
    assert [(t.name, t.pooling) for t in m.tables] == [
        ("user", Pooling.SUM),
        ("tags", Pooling.MEAN),
        ("hist", Pooling.NONE),
        ("cand", Pooling.NONE),
    ]


def test_a_sequence_tables_pooled_only_sharding_and_a_module_without_tables_are_one_line():
    configs, _ = _ec()
    constraints = {"hist": ParameterConstraints(sharding_types=["table_wise", "table_row_wise"])}
    with pytest.raises(SpecError) as err:
        ModelSpec.from_torchrec(configs, 64, constraints=constraints)
    assert str(err.value) == (
        "ParameterConstraints: hist.sharding_types: a sequence table (pooling: none) cannot be sharded "
        "table_row_wise; fix: allow only column_wise, data_parallel, ps_hash, row_wise, table_wise (TorchRec's "
        "EmbeddingCollectionSharder's types, and the parameter servers')"
    )
    with pytest.raises(SpecError, match="holds no EmbeddingBagCollection or EmbeddingCollection"):
        ModelSpec.from_torchrec(torch.nn.Linear(2, 2), 64)
    with pytest.raises(SpecError, match="gives the max sequence length of table 'nope'"):
        ModelSpec.from_torchrec(configs, 64, max_sequence_lengths={"nope": 3})
    with pytest.raises(SpecError, match="3 is under the table's mean sequence length 5"):
        ModelSpec.from_torchrec(configs, 64, pooling_factors={"hist": 5}, max_sequence_lengths={"hist": 3})
