"""DIN (modules/train/din.py) and its arch in model.yaml (persia_planner/model/dense.py): the network built is the one
priced, its attention weighs each sample's own ids (an empty sequence attends to nothing), and it trains over both
hybrid collections; model.yaml refuses an arch that cannot read the model's tables, in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from persia_planner import ModelSpec, SpecError
from persia_planner.model.dense import ArchKind, DenseArch, DenseSpec
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection
from persia_planner.modules.embedding.sequence_hybrid import HybridEmbeddingCollection
from persia_planner.modules.train.din import DIN, attend

DIM = 8
ARCH = DenseArch(ArchKind.DIN, num_dense=3, bottom=(16,), over=(32, 16, 1), attention=(12, 6))


def _model() -> DIN:
    bags = HybridEmbeddingBagCollection(
        [EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=50, feature_names=["user"])],
        keep_order=False,
    )
    sequences = HybridEmbeddingCollection(
        [
            EmbeddingConfig(name="item", embedding_dim=DIM, num_embeddings=100, feature_names=["hist", "cand"]),
            EmbeddingConfig(name="cats", embedding_dim=DIM, num_embeddings=20, feature_names=["cat_hist"]),
        ]
    )
    return DIN(bags, sequences, ARCH, DIM, ["user"], ["hist", "cand", "cat_hist"])


def _batch(gen: torch.Generator, batch: int = 5) -> KeyedJaggedTensor:
    keys = ["user", "hist", "cand", "cat_hist"]
    lengths = torch.cat(
        [
            torch.ones(batch, dtype=torch.int64),
            torch.tensor([0, 3, 1, 6, 2]),  # an empty history, and several lengths
            torch.ones(batch, dtype=torch.int64),
            torch.randint(0, 4, (batch,), generator=gen),
        ]
    )
    return KeyedJaggedTensor(
        keys=keys, values=torch.randint(0, 20, (int(lengths.sum()),), generator=gen), lengths=lengths
    )


def test_the_network_built_is_the_one_priced():
    model = _model()
    dense = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embedding_"))
    # the pooled "user" feature and the three sequence outputs; the counts take each sequence's mean length
    assert dense == DenseSpec.of_arch(ARCH, DIM, 1, (3.0, 1.0, 2.0)).parameters
    macs_short = ARCH.counts(DIM, 1, (1.0,))[1]
    macs_long = ARCH.counts(DIM, 1, (11.0,))[1]
    unit = 4 * DIM * 12 + 12 * 6 + 6 * 1
    assert macs_long - macs_short == 10 * (unit + 3 * DIM)  # every id costs its unit and its weighted sum


def test_it_trains_over_both_collections_and_an_empty_sequence_is_no_nan():
    torch.manual_seed(0)
    model = _model()
    gen = torch.Generator().manual_seed(1)
    batch, dense = _batch(gen), torch.randn(5, 3, generator=gen)
    logits = model(dense, batch)
    assert logits.shape == (5, 1) and torch.isfinite(logits).all()
    logits.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert float(grads["embedding_collection.local.ec.embeddings.item.weight"].abs().sum()) > 0
    assert float(grads["units.hist.0.weight"].abs().sum()) > 0


def test_attention_weighs_each_samples_own_ids():
    rows = JaggedTensor(values=torch.arange(12.0).reshape(6, 2), lengths=torch.tensor([2, 0, 4]))

    class Constant(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*x.shape[:-1], 1)

    out = attend(torch.zeros(3, 2), rows, Constant())  # equal scores: the mean of each sample's rows
    expected = torch.stack([rows.values()[:2].mean(0), torch.zeros(2), rows.values()[2:].mean(0)])
    assert torch.allclose(out, expected)


def _din_yaml(**dense):
    tables = [
        {"name": "user", "rows": 50, "dim": 8},
        {"name": "hist", "rows": 100, "dim": 8, "pooling": "none", "sequence_length": {"mean": 20, "max": 50}},
    ]
    return {"batch_size": 64, "tables": tables, "dense": {"arch": "din", **dense}}


def test_model_yaml_reads_din_and_refuses_an_arch_that_cannot_read_its_tables():
    spec = ModelSpec.from_dict(_din_yaml(attention=[24], bottom=[16], over=[32, 1]))
    arch = spec.dense.arch
    assert arch.kind is ArchKind.DIN and arch.attention == (24,)
    assert spec.dense == DenseSpec.of_arch(arch, 8, 1, (20.0,))
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    cases = {
        "dlrm": "model.yaml: dense.arch: 'dlrm' pools every feature, and the model has sequence tables (pooling: "
        "none); fix: set 'arch: din'",
    }
    bad = _din_yaml()
    bad["dense"]["arch"] = "dlrm"
    with pytest.raises(SpecError) as err:
        ModelSpec.from_dict(bad)
    assert str(err.value) == cases["dlrm"]
    pooled_only = {"batch_size": 64, "tables": [{"name": "u", "rows": 5, "dim": 8}], "dense": {"arch": "din"}}
    with pytest.raises(SpecError, match="'din' attends over sequence tables, and the model has none"):
        ModelSpec.from_dict(pooled_only)
    with pytest.raises(SpecError, match=r"dense.attention: is for 'arch: din' only"):
        ModelSpec.from_dict({**pooled_only, "dense": {"arch": "dcn", "attention": [8]}})


def test_a_sequence_longer_than_its_max_is_read_by_its_last_ids():
    from persia_planner.modules.train.din import last_ids

    rows = JaggedTensor(values=torch.arange(9.0).reshape(9, 1), lengths=torch.tensor([5, 0, 1, 3]))
    cut = last_ids(rows, 2)
    assert cut.lengths().tolist() == [2, 0, 1, 2]
    assert cut.values().flatten().tolist() == [3.0, 4.0, 5.0, 7.0, 8.0]  # each sample's most recent ids
    assert last_ids(rows, 5) is rows


def test_a_candidate_is_its_sequences_query_and_the_learned_query_goes():
    bags = HybridEmbeddingBagCollection(
        [EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=50, feature_names=["user"])],
        keep_order=False,
    )
    sequences = HybridEmbeddingCollection(
        [EmbeddingConfig(name="hist", embedding_dim=DIM, num_embeddings=100, feature_names=["hist", "cand"])]
    )
    model = DIN(bags, sequences, ARCH, DIM, ["user"], ["hist"], candidates={"hist": "cand"})
    assert model.query is None  # every sequence attends from its candidate
    dense = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embedding_"))
    assert dense == DenseSpec.of_arch(ARCH, DIM, 1, (3.0,), candidates=1).parameters
    gen = torch.Generator().manual_seed(2)
    lengths = torch.cat(
        [torch.ones(5, dtype=torch.int64), torch.tensor([0, 3, 1, 6, 2]), torch.ones(5, dtype=torch.int64)]
    )
    batch = KeyedJaggedTensor(keys=["user", "hist", "cand"], lengths=lengths,
                              values=torch.randint(0, 50, (int(lengths.sum()),), generator=gen))  # fmt: skip
    logits = model(torch.randn(5, 3, generator=gen), batch)
    logits.sum().backward()
    assert logits.shape == (5, 1) and torch.isfinite(logits).all()
    grad = sequences.local.ec.embeddings["hist"].weight.grad
    cand_ids = batch["cand"].values() % 100
    assert float(grad[cand_ids].abs().sum()) > 0  # the candidates' rows of the history's table learn
