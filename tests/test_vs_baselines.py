"""benchmarks/vs_baselines.py's pure parts: the splits are deterministic and disjoint, a split's files hold the
user's rows as they were, the baselines' design matrix follows the model's columns, and the factorization machine
learns an interaction the logistic regression cannot (persia's runs are the benchmark's, in CI)."""

from __future__ import annotations

import numpy as np
import pytest
from benchmark_modules import load

from persia_planner.errors import PlannerError

logs = load("click_logs")  # first: the others import it by name
features = load("log_features")
models = load("baseline_models")


def test_a_random_split_is_the_same_for_a_seed_disjoint_and_covers_every_row():
    first, again, other = (logs.random_split(1000, 0.1, seed) for seed in (0, 0, 1))
    assert np.array_equal(first.train, again.train) and np.array_equal(first.valid, again.valid)
    assert len(first.valid) == 100 and len(first.train) == 900
    assert not set(first.train) & set(first.valid)
    assert sorted([*first.train, *first.valid]) == list(range(1000))
    assert list(first.valid) == sorted(first.valid)  # in file order
    assert not np.array_equal(first.valid, other.valid)
    assert first.name == "random 0" and not first.by_time


def test_a_split_by_time_validates_on_the_latest_rows_and_its_inner_split_too():
    times = np.array([5, 1, 9, 3, 7, 2, 8, 6, 4, 0])
    split = logs.time_split(times, 0.2)
    assert split.by_time
    assert list(split.valid) == [6, 2]  # times 8, 9
    assert list(times[split.train]) == [0, 1, 2, 3, 4, 5, 6, 7]  # in time order
    inner = logs.inner_split(split, seed=3)
    assert list(inner.valid) == [7] and list(inner.train) == list(range(7))  # positions into split.train


def test_an_inner_split_of_a_random_split_is_drawn_by_its_seed():
    split = logs.random_split(200, 0.1, 0)
    inner = logs.inner_split(split, seed=0)
    assert len(inner.valid) == 18 and sorted([*inner.train, *inner.valid]) == list(range(180))
    assert np.array_equal(inner.valid, logs.inner_split(split, seed=0).valid)


def test_a_share_that_leaves_a_side_empty_is_refused():
    with pytest.raises(PlannerError, match="valid-share"):
        logs.random_split(10, 1.5, 0)
    with pytest.raises(PlannerError, match="no row"):
        logs.random_split(1, 0.5, 0)


def test_a_log_is_named_as_persia_names_it(tmp_path):
    (tmp_path / "a.csv").write_text("x,click\n1,0\n")
    (tmp_path / "day_0").write_text("0\t1\n")
    assert logs.LogSource.parse(f"csv:{tmp_path / 'a.csv'}").kind is logs.LogKind.CSV
    assert logs.LogSource.parse(str(tmp_path / "a.csv")).kind is logs.LogKind.CSV
    day = logs.LogSource.parse(str(tmp_path / "day_0"))
    assert day.kind is logs.LogKind.CRITEO and day.arg() == f"criteo:{tmp_path / 'day_0'}"
    with pytest.raises(PlannerError, match="unknown kind 'tsv'"):
        logs.LogSource.parse(f"tsv:{tmp_path / 'a.csv'}")
    with pytest.raises(PlannerError, match="does not exist"):
        logs.LogSource.parse(f"csv:{tmp_path / 'b.csv'}")


def test_a_split_writes_the_rows_bytes_as_they_were(tmp_path):
    text = b'user,genres,click\n007,"a b",1\n1,x,0\n2,,1\n'
    (tmp_path / "log.csv").write_bytes(text)
    rows = logs.read_rows(logs.LogSource.parse(f"csv:{tmp_path / 'log.csv'}"))
    assert len(rows) == 3
    out = logs.write_rows(rows, np.array([2, 0]), tmp_path / "part.csv")
    assert out.read_bytes() == b'user,genres,click\n2,,1\n007,"a b",1\n'


def test_csv_files_of_a_folder_must_share_their_header(tmp_path):
    (tmp_path / "a.csv").write_text("x,click\n1,0\n")
    (tmp_path / "b.csv").write_text("y,click\n1,0\n")
    with pytest.raises(PlannerError, match="header differs"):
        logs.read_rows(logs.LogSource.parse(f"csv:{tmp_path}"))


def _columns():
    return features.FeatureColumns(
        "click",
        (features.DenseColumn("n", (0.0, 100.0)),),
        (features.IdColumn("user"), features.IdColumn("genres", " ")),
    )


def test_the_design_one_hots_the_training_ids_and_standardizes_log1p_dense_values(tmp_path):
    (tmp_path / "train.csv").write_text("user,genres,n,click\nu1,a b,0,1\nu2,b,1000,0\nu1,,3,1\n")
    (tmp_path / "valid.csv").write_text("user,genres,n,click\nu3,b c,,0\n")
    kind, columns = logs.LogKind.CSV, _columns()
    train = features.read_features(kind, tmp_path / "train.csv", columns)
    valid = features.read_features(kind, tmp_path / "valid.csv", columns)
    design = features.one_hot(train, valid, columns)
    assert design.widths == {"n": 1, "user": 2, "genres": 2}  # u1 u2; a b
    assert list(design.y_train) == [1, 0, 1] and list(design.y_valid) == [0]
    dense = np.log1p([0.0, 100.0, 3.0])  # clipped at 100, then log1p
    standardized = (dense - dense.mean()) / dense.std()
    x = design.train.toarray()
    np.testing.assert_allclose(x[:, 0], standardized)
    assert x[:, 1:3].sum(axis=1).tolist() == [1, 1, 1]  # one user each
    assert x[:, 3:5].tolist() == [[1, 1], [0, 1], [0, 0]]  # genres a, b: multi-hot, one row without any
    # u3 and c were never trained: no column; a missing dense value reads as the training rows' mean.
    assert design.valid.toarray().tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]


def test_a_csv_model_without_a_data_section_is_refused(tmp_path):
    model = tmp_path / "model.yaml"
    model.write_text("name: m\nbatch_size: 8\ntables:\n- {name: t, rows: 10, dim: 4}\n")
    with pytest.raises(PlannerError, match="no data: section"):
        features.FeatureColumns.of_model(model, logs.LogKind.CSV)


def _interaction(rows: int, seed: int):
    """Users and items in two groups each; a click where the groups agree: every id alone says nothing."""
    from scipy import sparse

    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, 20, rows), rng.integers(0, 20, rows)
    clicks = ((users % 2 == items % 2) ^ (rng.random(rows) < 0.05)).astype(np.float64)
    cols = np.stack([users, 20 + items], axis=1).ravel()
    x = sparse.csr_matrix((np.ones(2 * rows), (np.repeat(np.arange(rows), 2), cols)), shape=(rows, 40))
    return x, clicks


def test_the_factorization_machine_learns_an_interaction_the_logistic_regression_cannot():
    x, y = _interaction(2000, seed=0)
    x_valid, y_valid = _interaction(1000, seed=1)
    inner = logs.random_split(2000, 0.1, 0)
    settings = models.FmSettings(dim=8, lr=0.05, batch_size=128, max_epochs=8)
    fm = models.factorization_machine(x, y, x_valid, inner, seed=0, settings=settings)
    lr = models.logistic_regression(x, y, x_valid, inner)
    assert models.auc(y_valid, fm.scores) > 0.9
    assert models.auc(y_valid, lr.scores) < 0.6
    assert 1 <= fm.chosen["epochs"] <= 8 and fm.chosen["l2"] in models.FM_L2_GRID
    assert lr.chosen["C"] in models.C_GRID


def test_persia_options_are_pairs_of_an_option_and_its_value():
    load("persia_cli")
    bench = load("vs_baselines")

    def parsed(text: str) -> dict[str, str]:
        return bench.persia_options(bench.argparse.Namespace(persia_options=text))

    assert parsed("") == {}
    assert parsed("--sparse-eps 1e-8 --sparse-lr '0.05'") == {"--sparse-eps": "1e-8", "--sparse-lr": "0.05"}
    for bad in ("--sparse-eps", "1e-8 --sparse-eps", "--a 1 b 2"):
        with pytest.raises(PlannerError, match="not pairs of --option value"):
            parsed(bad)
    with pytest.raises(PlannerError, match="No closing quotation"):
        parsed("--sparse-lr '0.05")
