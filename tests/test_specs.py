import pytest
import yaml

from persia_planner import DType, ModelSpec, Optimizer, SpecError, load_model
from persia_planner.model.specs import TableSpec
from persia_planner.paths import EXAMPLE_MODEL

BASE = {
    "name": "m",
    "batch_size": 1024,
    "tables": [{"name": "user", "rows": "40_000_000", "dim": 128, "pooling_factor": 2.5, "zipf_alpha": 1.05}],
    "dense": {"parameters": "5_000_000", "flops_per_sample": 3e7},
}


def test_reads_every_field():
    m = ModelSpec.from_dict(BASE)
    t = m.tables[0]
    assert (t.name, t.rows, t.dim, t.pooling_factor, t.zipf_alpha) == ("user", 40_000_000, 128, 2.5, 1.05)
    assert t.optimizer is Optimizer.ROWWISE_ADAGRAD
    assert m.embedding_dtype is DType.FP32
    assert m.dense.parameters == 5_000_000 and m.dense.flops_per_sample == 3e7
    assert m.staleness == 4


def test_formats_md_example_bytes():
    # formats.md: user_id 40M x 128 fp32 rowwise_adagrad split in two row shards of 10,320,000,000 bytes.
    t = TableSpec("user_id", 40_000_000, 128)
    assert t.bytes(DType.FP32) == 2 * 10_320_000_000


@pytest.mark.parametrize(
    ("optimizer", "dtype", "row_bytes"),
    [
        (Optimizer.SGD, DType.FP32, 64 * 4),
        (Optimizer.ROWWISE_ADAGRAD, DType.FP32, 64 * 4 + 4),
        (Optimizer.ROWWISE_ADAGRAD, DType.FP16, 64 * 2 + 4),
        (Optimizer.ADAGRAD, DType.FP16, 64 * 2 + 64 * 4),  # fbgemm's momentum is float32 under fp16 weights
        (Optimizer.ADAM, DType.FP32, 64 * 4 * 3),
        (Optimizer.ADAM, DType.FP16, 64 * 2 + 2 * 64 * 4),
    ],
)
def test_state_bytes_per_optimizer(optimizer, dtype, row_bytes):
    assert TableSpec("t", 10, 64, optimizer=optimizer).row_bytes(dtype) == row_bytes


def test_count_expands_names():
    data = {"batch_size": 8, "tables": [{"name": "f", "rows": 10, "dim": 4, "count": 3}]}
    assert [t.name for t in ModelSpec.from_dict(data).tables] == ["f_0", "f_1", "f_2"]


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"batch_size": "big"}, "model.yaml: batch_size: 'big' is not a whole number like 40_000_000 or 1e9"),
        (
            {"tables": [{"name": "a", "rows": 10, "dim": 4, "pooling_factr": 2}]},
            "model.yaml: tables[0].pooling_factr: unknown key; fix: did you mean 'pooling_factor'?",
        ),
        ({"tables": [{"name": "a", "rows": "12XB", "dim": 4}]}, "model.yaml: tables[0].rows: unknown unit 'XB'"),
        ({"tables": [{"name": "a", "rows": 10, "dim": 0}]}, "model.yaml: tables[0].dim: must be > 0, got 0"),
        (
            {"tables": [{"name": "a", "rows": 10, "dim": 4, "optimizer": "lamb"}]},
            "model.yaml: tables[0].optimizer: unknown value 'lamb'; "
            "fix: use one of sgd | rowwise_adagrad | adagrad | adam",
        ),
        ({"tables": []}, "model.yaml: tables: the model has no tables"),
        (
            {"tables": [{"name": "a", "rows": 1, "dim": 4}, {"name": "a", "rows": 1, "dim": 4}]},
            "model.yaml: tables[1].name: table name 'a' is already used by tables[0]",
        ),
        ({"embedding_dtype": "fp64"}, "model.yaml: embedding_dtype: unknown value 'fp64'"),
        ({"tabels": []}, "model.yaml: tabels: unknown key; fix: did you mean 'tables'?"),
        (
            {"tables": [{"name": "a", "rows": 10, "dim": 4, "count": 10**9}]},
            "model.yaml: tables[0].count: must be <= 1,000,000, got 1000000000; fix: use at most 1,000,000",
        ),
    ],
)
def test_errors_name_file_and_key_path(patch, message):
    data = {**BASE, **patch}
    with pytest.raises(SpecError) as err:
        ModelSpec.from_dict(data)
    assert str(err.value).startswith(message)


def test_load_model_file_errors(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("tables: [\n")
    with pytest.raises(SpecError, match=r"m.yaml: malformed YAML at line \d+, column \d+"):
        load_model(bad)
    # A key given twice is refused, not resolved to the last one (that silently replaced 100M rows by 1000).
    bad.write_text(
        "name: m\nbatch_size: 64\ntables:\n  - name: a\n    rows: 100_000_000\n    dim: 16\n    rows: 1000\n"
    )
    with pytest.raises(SpecError, match=r"m.yaml: tables\[0\]\.rows: key given twice in one mapping \(line 7\)"):
        load_model(bad)
    with pytest.raises(SpecError, match="file not found"):
        load_model(tmp_path / "nope.yaml")


def test_load_model_non_utf8_file(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError) as err:
        load_model(bad)
    assert str(err.value) == f"{bad}: not UTF-8 text (byte 0xe9 at offset 9); fix: save it as UTF-8"


def test_from_torchrec_configs():
    torchrec = pytest.importorskip("torchrec")
    configs = [
        torchrec.EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=100, feature_names=["f0"]),
        torchrec.EmbeddingBagConfig(name="t1", embedding_dim=32, num_embeddings=1000, feature_names=["f1"]),
    ]
    import torch

    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    for source in (configs, ebc):
        m = ModelSpec.from_torchrec(source, batch_size=512, pooling_factors={"t1": 3.0})
        assert [(t.name, t.rows, t.dim, t.pooling_factor) for t in m.tables] == [
            ("t0", 100, 16, 1.0),
            ("t1", 1000, 32, 3.0),
        ]
        assert m.batch_size == 512


def test_a_table_may_have_its_own_dtype():
    m = ModelSpec.from_dict(
        {
            "batch_size": 8,
            "embedding_dtype": "fp16",
            "ps_wire_dtype": "bf16",
            "tables": [
                {"name": "a", "rows": 10, "dim": 8},
                {"name": "b", "rows": 10, "dim": 8, "embedding_dtype": "fp32"},
            ],
        }
    )
    assert m.table_dtypes == {"a": DType.FP16, "b": DType.FP32} and m.ps_wire_dtype is DType.BF16
    # rowwise_adagrad: one float32 of state per row, whatever the weights' dtype
    assert m.total_bytes == 10 * (8 * 2 + 4) + 10 * (8 * 4 + 4)


def test_from_torchrec_keeps_each_tables_dtype_and_refuses_one_it_cannot_train():
    torchrec = pytest.importorskip("torchrec")
    from torchrec.modules.embedding_configs import DataType

    def config(name, data_type):
        return torchrec.EmbeddingBagConfig(
            name=name, embedding_dim=16, num_embeddings=100, feature_names=[name], data_type=data_type
        )

    m = ModelSpec.from_torchrec(
        [config("h0", DataType.FP16), config("f", DataType.FP32), config("h1", DataType.FP16)], batch_size=64
    )
    assert m.table_dtypes == {"h0": DType.FP16, "f": DType.FP32, "h1": DType.FP16}
    assert m.embedding_dtype is DType.FP16  # the most common one is the model's default
    with pytest.raises(SpecError) as err:
        ModelSpec.from_torchrec([config("f", DataType.FP32), config("q", DataType.INT8)], batch_size=64)
    assert str(err.value) == (
        "EmbeddingBagConfig: q.data_type: 'int8' is not a trainable embedding dtype (fp32, fp16, bf16); "
        "fix: train the table in fp32, fp16 or bf16 and quantize it for inference"
    )


def test_to_dict_is_read_back_as_an_equal_spec():
    text = {
        "name": "m",
        "batch_size": 64,
        "embedding_dtype": "fp16",
        "staleness": 2,
        "tables": [
            {"name": "u", "rows": 1000, "dim": 16, "pooling_factor": 2.5, "zipf_alpha": 1.1},
            {"name": "i", "rows": 50, "dim": 16, "embedding_dtype": "fp32", "optimizer": "sgd",
             "constraints": {"sharding_types": ["table_wise"], "tiers": ["hbm", "ps"]}},
        ],
        "dense": {"arch": "dcn", "bottom": [32], "over": [16, 1], "dcn_layers": 2, "dcn_low_rank": 4},
        "data": {
            "label": "y",
            "dense": [{"column": "age", "clip": [0, 99], "standardize": True, "mean": 30.0, "std": 9.0}],
            "sparse": {"u": "user", "item": {"column": "items", "table": "i", "separator": "|"}},
        },
    }  # fmt: skip
    for spec in (ModelSpec.from_dict(text), load_model(EXAMPLE_MODEL)):
        written = yaml.safe_load(yaml.safe_dump(spec.to_dict(), sort_keys=False))  # the features keep their order
        assert ModelSpec.from_dict(written) == spec
    counts = ModelSpec.from_dict({"batch_size": 8, "tables": [{"name": "t", "rows": 9, "dim": 4}],
                                  "dense": {"parameters": 1000, "flops_per_sample": 2e3}})  # fmt: skip
    assert ModelSpec.from_dict(counts.to_dict()) == counts
