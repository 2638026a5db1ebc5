"""The dense arch of model.yaml: parsed with one-line errors naming the key, and its derived counts equal to the
parameters of the TorchRec module persia train builds from it."""

from __future__ import annotations

import pytest

from persia_planner.errors import SpecError
from persia_planner.model.dense import ArchError, ArchKind, DenseArch, DenseSpec
from persia_planner.model.specs import ModelSpec, load_model


def model_dict(dense: dict | None, dims: tuple[int, ...] = (8, 8, 8)) -> dict:
    out = {"batch_size": 64, "tables": [{"name": f"t{i}", "rows": 100, "dim": d} for i, d in enumerate(dims)]}
    if dense is not None:
        out["dense"] = dense
    return out


def test_an_arch_is_read_and_its_counts_derived(tmp_path):
    path = tmp_path / "dcn.yaml"
    path.write_text(
        "batch_size: 64\n"
        "tables:\n  - {name: t, rows: 100, dim: 8, count: 3}\n"
        "dense:\n  arch: dcn\n  num_dense: 4\n  bottom: [16]\n  over: [32, 1]\n  dcn_layers: 2\n  dcn_low_rank: 3\n"
    )
    dense = load_model(path).dense
    assert dense.arch == DenseArch(ArchKind.DCN, 4, (16,), (32, 1), 2, 3)
    # By hand: bottom 4->16->8, cross N = 4 x 8 = 32 (2 layers of W 32x3, V 3x32, b 32), over 32->32->1.
    bottom = (4 * 16 + 16) + (16 * 8 + 8)
    cross = 2 * (32 * 3 + 3 * 32 + 32)
    over = (32 * 32 + 32) + (32 * 1 + 1)
    assert dense.parameters == bottom + cross + over
    macs = (4 * 16 + 16 * 8) + 2 * (2 * 32 * 3 + 32) + (32 * 32 + 32)
    assert dense.flops_per_sample == 2.0 * macs
    assert dense.built_arch is dense.arch


def test_counts_alone_keep_the_default_dlrm():
    dense = ModelSpec.from_dict(model_dict({"parameters": "20_000", "flops_per_sample": 4e4})).dense
    assert (dense.parameters, dense.flops_per_sample, dense.arch) == (20_000, 4e4, None)
    assert dense.built_arch == DenseArch()  # 13 dense inputs, bottom (64,), over (64, 32, 1)
    assert ModelSpec.from_dict(model_dict(None)).dense == DenseSpec()
    dlrm = ModelSpec.from_dict(model_dict({"arch": "dlrm"})).dense
    assert (dlrm.parameters, dlrm.flops_per_sample) == (
        DenseSpec.dlrm(13, 8, 3).parameters,
        DenseSpec.dlrm(13, 8, 3).flops_per_sample,
    )


@pytest.mark.parametrize(
    ("dense", "message"),
    [
        ({"arch": "wide"}, "dense.arch: unknown value 'wide'; fix: use one of dlrm | dcn"),
        ({"arch": "dlrm", "parameters": 5}, "dense.parameters: is derived from 'arch: dlrm' and cannot be given"),
        ({"arch": "dcn", "flops_per_sample": 5}, "dense.flops_per_sample: is derived from 'arch: dcn'"),
        ({"arch": "dlrm", "over": [64, 32]}, "dense.over: must have at least two layers and end in 1 (the logit), got"),
        ({"arch": "dlrm", "over": [1]}, "dense.over: must have at least two layers and end in 1"),
        ({"arch": "dlrm", "bottom": [64, 0]}, "dense.bottom: layer 1 is 0, not a positive integer"),
        ({"arch": "dlrm", "bottom": [64, "x"]}, "dense.bottom: layer 1 is 'x', not a positive integer"),
        ({"arch": "dlrm", "bottom": 64}, "dense.bottom: expected a list of layer sizes, got 64"),
        ({"arch": "dlrm", "bottom": [2_000_000]}, "dense.bottom: layer size 2000000 is not in [1, 1,048,576]"),
        ({"arch": "dlrm", "over": [8] * 101 + [1]}, "dense.over: has 102 layers, more than 100"),
        ({"arch": "dlrm", "num_dense": 0}, "dense.num_dense: must be > 0, got 0"),
        ({"arch": "dcn", "dcn_layers": -1}, "dense.dcn_layers: -1 must be a finite, non-negative count"),
        ({"arch": "dcn", "dcn_low_rank": 0}, "dense.dcn_low_rank: must be > 0, got 0"),
        ({"arch": "dcn", "dcn_layers": 101}, "dense.dcn_layers: must be <= 100"),
        ({"arch": "dlrm", "dcn_layers": 2}, "dense.dcn_layers: is for 'arch: dcn' only"),
        ({"bottom": [64]}, "dense.bottom: describes a dense arch, but 'arch' is not given"),
        ({"arch": "dlrm", "depth": 3}, "dense.depth: unknown key"),
        ({"arch": "dcn", "bottom": [1_000_000], "over": [1_000_000] * 90 + [1]}, "over the ceilings"),
    ],
)
def test_a_bad_dense_field_is_one_line_naming_it(dense, message):
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict(model_dict(dense))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_arch_needs_one_embedding_dim():
    with pytest.raises(
        SpecError, match=r"dense.arch: 'dcn' needs one embedding dim for all tables \(its interaction\), got \[4, 8\]"
    ):
        ModelSpec.from_dict(model_dict({"arch": "dcn"}, dims=(8, 4)))


def test_the_python_api_refuses_a_bad_arch_naming_the_field():
    with pytest.raises(ArchError, match=r"dense.over: must have at least two layers and end in 1"):
        DenseArch(over=(64, 2))
    with pytest.raises(ArchError, match=r"dense.num_dense: must be an integer in \[1, 1,000,000\], got 0"):
        DenseArch(num_dense=0)
    assert DenseArch(kind="dcn", bottom=[32]).kind is ArchKind.DCN  # strings and lists are accepted


@pytest.mark.parametrize(
    "arch",
    [
        DenseArch(),
        DenseArch(ArchKind.DLRM, 5, (), (16, 8, 1)),
        DenseArch(ArchKind.DCN),
        DenseArch(ArchKind.DCN, 7, (32, 16), (24, 1), dcn_layers=4, dcn_low_rank=5),
    ],
)
def test_the_derived_parameters_are_those_of_torchrecs_module(arch):
    """The count the planner prices is the parameter count of TorchRec's DLRM / DLRM_DCN, built the way
    ``build_model`` builds it, counted by torch."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from persia_planner.modules.train.loop import build_model

    dim, features = 8, 5
    spec = ModelSpec.from_dict(
        {
            "batch_size": 64,
            "tables": [{"name": "t", "rows": 50, "dim": dim, "count": features}],
            "dense": arch.to_dict(),
        }
    )
    model, hybrid = build_model(spec, None)
    kind = "DLRM_DCN" if arch.kind is ArchKind.DCN else "DLRM"
    assert type(model).__name__ == kind
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("sparse_arch."))
    assert dense == spec.dense.parameters == DenseSpec.of_arch(arch, dim, features).parameters
    assert sum(p.numel() for p in hybrid.parameters()) == features * 50 * dim
    # The same network over a plain EmbeddingBagCollection: the hybrid collection adds nothing to the dense part.
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{i}", feature_names=[f"t{i}"], num_embeddings=50, embedding_dim=dim)
            for i in range(features)
        ],
        device=torch.device("meta"),
    )
    sizes = {
        "dense_in_features": arch.num_dense,
        "dense_arch_layer_sizes": [*arch.bottom, dim],
        "over_arch_layer_sizes": list(arch.over),
    }
    plain = (
        DLRM_DCN(ebc, **sizes, dcn_num_layers=arch.dcn_layers, dcn_low_rank_dim=arch.dcn_low_rank)
        if arch.kind is ArchKind.DCN
        else DLRM(ebc, **sizes)
    )
    assert sum(p.numel() for n, p in plain.named_parameters() if not n.startswith("sparse_arch.")) == dense
