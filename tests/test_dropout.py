"""model.yaml's ``dense: dropout:``: read with one-line errors, recorded with the arch, and applied by the model persia
train builds to the hidden layers' outputs in training only, its parameters and state_dict keys TorchRec's own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import SpecError
from persia_planner.model.dense import ArchError, ArchKind, DenseArch
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.train.loop import torchrec_model


def model_dict(dense: dict) -> dict:
    return {"batch_size": 64, "tables": [{"name": f"t{i}", "rows": 100, "dim": 8} for i in range(3)], "dense": dense}


def test_dropout_is_read_recorded_and_priced_as_nothing():
    spec = ModelSpec.from_dict(model_dict({"arch": "dcn", "dropout": 0.2}))
    plain = ModelSpec.from_dict(model_dict({"arch": "dcn"}))
    assert spec.dense.arch.dropout == 0.2 and plain.dense.arch.dropout == 0.0
    assert (spec.dense.parameters, spec.dense.flops_per_sample) == (
        plain.dense.parameters,
        plain.dense.flops_per_sample,
    )
    assert spec.dense.arch.to_dict()["dropout"] == 0.2 and "dropout" not in plain.dense.arch.to_dict()
    recorded = spec.dense.arch.to_dict()  # as a checkpoint's hyper_parameters hold it
    assert DenseArch(kind=recorded.pop("arch"), **recorded) == replace(spec.dense.arch, inputs_from_data=False)


@pytest.mark.parametrize(
    ("dense", "message"),
    [
        ({"arch": "dlrm", "dropout": 1.0}, "dense.dropout: must be a probability in [0, 1), got 1.0"),
        ({"arch": "dlrm", "dropout": 1.5}, "dense.dropout: must be <= 1"),
        ({"arch": "dlrm", "dropout": -0.1}, "dense.dropout: -0.1 must be a finite, non-negative number"),
        ({"arch": "dlrm", "dropout": "lots"}, "dense.dropout: 'lots' is not a number"),
        ({"dropout": 0.1}, "dense.dropout: describes a dense arch, but 'arch' is not given"),
    ],
)
def test_a_bad_dropout_is_one_line_naming_it(dense, message):
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict(model_dict(dense))
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ArchError, match=r"dense.dropout: must be a probability"):
        DenseArch(dropout=True)


def built(arch: DenseArch) -> torch.nn.Module:
    configs = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=50, embedding_dim=8) for i in range(3)
    ]
    torch.manual_seed(0)
    return torchrec_model(EmbeddingBagCollection(tables=configs), arch, 8)


def inputs() -> tuple[torch.Tensor, KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.ones(3 * 32, dtype=torch.int64)
    sparse = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"], values=torch.randint(0, 50, (96,), generator=gen), lengths=lengths
    )
    return torch.randn(32, 4, generator=gen), sparse


@pytest.mark.parametrize("kind", [ArchKind.DLRM, ArchKind.DCN])
def test_dropout_acts_in_training_and_not_in_evaluation(kind):
    arch = DenseArch(kind, num_dense=4, bottom=(16,), over=(32, 16, 1), dropout=0.5)
    model, plain = built(arch), built(DenseArch(kind, num_dense=4, bottom=(16,), over=(32, 16, 1)))
    assert model.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)  # the same seeded weights, no parameter added
    dense, sparse = inputs()
    model.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(model(dense, sparse), plain(dense, sparse))  # off in evaluation
    model.train()
    plain.train()
    torch.manual_seed(1)
    first = model(dense, sparse)
    torch.manual_seed(2)
    second = model(dense, sparse)
    assert not torch.equal(first, plain(dense, sparse)) and not torch.equal(first, second)
    # where it acts: the bottom MLP's hidden layer (not its output, the dense embedding) and the over arch's two
    hidden = []
    for net in (model, plain):
        last = net.dense_arch.model._mlp[-1]
        hook = last.register_forward_hook(lambda _m, args, _out: hidden.append(args[0].detach()))
        net(dense, sparse)
        hook.remove()
    dropped, full = hidden
    alive = full != 0
    kept = dropped[alive] != 0
    assert 0.4 < float(kept.float().mean()) < 0.6  # about half of the hidden outputs dropped
    torch.testing.assert_close(dropped[alive][kept], 2 * full[alive][kept])  # the rest scaled by 1 / (1 - p)
    assert torch.equal(dropped[~alive], full[~alive])
