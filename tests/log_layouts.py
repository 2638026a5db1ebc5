"""Small click logs in the exact layouts of the public ones, generated (their terms forbid copying samples here): Criteo
(``label \\t 13 counts \\t 26 hex ids``, or the same columns as a CSV with a header), Avazu (``id,click,hour,C1,...``)
and MovieLens-100K as clicks (``user_id,item_id,age,gender,occupation,zip_code,release_year,genres,timestamp,
click``, genres space-separated). Each column is drawn as the real one is spread: heavy-tailed counts, Zipf-skewed
ids and codes from the real code sets, a row id unique per row, a constant hour; the label follows a few features,
so a model can learn it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from persia_planner.modules.data.criteo_format import CATEGORICAL_COLUMNS, INTEGER_COLUMNS, write_criteo

__all__ = ["AVAZU_COLUMNS", "MOVIELENS_COLUMNS", "avazu_log", "criteo_csv", "criteo_log", "movielens_log"]

AVAZU_COLUMNS = (
    *("id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain"),
    *("app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type"),
    *("C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"),
)
MOVIELENS_COLUMNS = (
    "user_id",
    "item_id",
    "age",
    "gender",
    "occupation",
    "zip_code",
    "release_year",
    "genres",
    "timestamp",
    "click",
)
_GENRES = ("Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Drama", "Film-Noir", "Horror")


def _zipf(rng: np.random.Generator, n: int, vocab: int, a: float = 1.2) -> np.ndarray:
    """``n`` draws from ``0..vocab-1``, Zipf-skewed (rank 0 the most frequent)."""
    weights = 1.0 / np.arange(1, vocab + 1) ** a
    return rng.choice(vocab, size=n, p=weights / weights.sum())


def _clicks(rng: np.random.Generator, *signals: np.ndarray) -> np.ndarray:
    """0/1 labels whose log-odds are the sum of ``signals`` (each about unit scale), about 20% positive."""
    logit = -1.5 + sum(signals)
    return (rng.random(len(logit)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)


def _criteo_columns(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    counts = np.floor(rng.lognormal(mean=rng.uniform(0.5, 4.0, 13), sigma=1.6, size=(rows, 13))).astype(np.int64)
    counts[:, 1][rng.random(rows) < 0.03] = -1  # I2's few -1s
    count_missing = rng.random((rows, 13)) < rng.uniform(0.0, 0.4, 13)
    vocab = rng.integers(5, max(6, rows // 2), 26)
    ranks = np.stack([_zipf(rng, rows, int(v)) for v in vocab], axis=1)
    ids = (ranks * 2654435761 + np.arange(26) * 40503) % (1 << 32)  # 8 hex digits, as the real ids
    id_missing = rng.random((rows, 26)) < 0.05
    signal = np.log1p(np.maximum(counts[:, 0], 0)) / 3 - (ranks[:, 0] % 5 == 0) + (ranks[:, 2] < 3)
    return _clicks(rng, signal), counts, count_missing, ids, id_missing


def criteo_log(path: Path, rows: int = 2000, seed: int = 0) -> Path:
    """A Criteo TSV file (no header) of ``rows`` rows."""
    labels, counts, count_missing, ids, id_missing = _criteo_columns(rows, seed)
    return write_criteo(path, labels, counts, ids, int_missing=count_missing, cat_missing=id_missing)


def criteo_csv(path: Path, rows: int = 2000, seed: int = 0) -> Path:
    """The Criteo columns as a CSV file with a header (``label,I1..I13,C1..C26``), as a user converts them."""
    labels, counts, count_missing, ids, id_missing = _criteo_columns(rows, seed)
    lines = [",".join(("label", *INTEGER_COLUMNS, *CATEGORICAL_COLUMNS))]
    for r in range(rows):
        ints = ["" if count_missing[r, k] else str(counts[r, k]) for k in range(13)]
        cats = ["" if id_missing[r, k] else f"{ids[r, k]:08x}" for k in range(26)]
        lines.append(",".join((str(labels[r]), *ints, *cats)))
    path.write_text("\n".join(lines) + "\n")
    return path


def avazu_log(path: Path, rows: int = 2000, seed: int = 0) -> Path:
    """An Avazu CSV file of ``rows`` rows of one hour (its ``hour`` constant, as in a sample of a day's first hour)."""
    rng = np.random.default_rng(seed)
    row_ids = rng.integers(1, 2**63, size=rows, dtype=np.int64).astype(np.uint64) * np.uint64(2)  # unique 64-bit
    codes = {
        "C1": np.array([1005, 1002, 1010, 1012, 1007, 1001, 1008]),
        "banner_pos": np.array([0, 1, 7, 2, 4, 5, 3]),
        "device_type": np.array([1, 0, 4, 5, 2]),
        "device_conn_type": np.array([0, 2, 3, 5]),
        "C15": np.array([320, 300, 216, 728, 120, 1024, 480, 768]),
        "C16": np.array([50, 250, 36, 480, 90, 20, 768, 1024]),
        "C18": np.array([0, 3, 2, 1]),
    }
    ranks = {name: _zipf(rng, rows, len(values), a=2.0) for name, values in codes.items()}
    drawn = {name: codes[name][ranks[name]] for name in codes}
    drawn["C14"] = 15000 + 7 * _zipf(rng, rows, 300)
    drawn["C17"] = 112 + 13 * _zipf(rng, rows, 120)
    drawn["C19"] = np.array([35, 39, 167, 161, 47, 1327, 303, 683, 1063, 1839, 33])[_zipf(rng, rows, 11)]
    c20 = 100000 + _zipf(rng, rows, 200)
    drawn["C20"] = np.where(rng.random(rows) < 0.47, -1, c20)
    drawn["C21"] = np.array([23, 221, 79, 48, 71, 61, 157, 32, 1, 255])[_zipf(rng, rows, 10)]
    text = {
        name: _zipf(rng, rows, vocab)
        for name, vocab in (
            ("site_id", 400),
            ("site_domain", 300),
            ("site_category", 12),
            ("app_id", 250),
            ("app_domain", 60),
            ("app_category", 15),
            ("device_id", rows // 2),
            ("device_ip", rows),
            ("device_model", 600),
        )
    }
    signal = (
        (ranks["banner_pos"] == 1) * 1.0 + (text["site_id"] < 5) - (drawn["C15"] == 216) + (text["app_id"] % 7 == 0)
    )
    clicks = _clicks(rng, signal)
    lines = [",".join(AVAZU_COLUMNS)]
    for r in range(rows):
        fields = [str(row_ids[r]), str(clicks[r]), "14102100", str(drawn["C1"][r]), str(drawn["banner_pos"][r])]
        for name in AVAZU_COLUMNS[5:14]:
            fields.append(f"{(text[name][r] * 2654435761 + len(name)) % (1 << 32):08x}")
        fields += [str(drawn[name][r]) for name in AVAZU_COLUMNS[14:]]
        lines.append(",".join(fields))
    path.write_text("\n".join(lines) + "\n")
    return path


def movielens_log(path: Path, rows: int = 3000, seed: int = 0, delimiter: str = ",") -> Path:
    """MovieLens-100K as clicks (rating >= 4), ``rows`` ratings of 300 users and 500 items; fields separated by
    ``delimiter``, genres by spaces."""
    rng = np.random.default_rng(seed)
    users, items = 300, 500
    user_age = rng.integers(7, 74, users)
    user_gender = rng.choice(["M", "F"], users)
    user_job = rng.choice(["writer", "executive", "student", "engineer", "other", "artist"], users)
    user_zip = np.array([f"{z:05d}" for z in rng.integers(0, 99999, users)])
    item_year = rng.integers(1930, 1999, items)
    item_genres = [
        " ".join(sorted(set(rng.choice(_GENRES, size=rng.integers(1, 4), replace=True).tolist()))) for _ in range(items)
    ]
    taste = rng.normal(size=users)
    quality = rng.normal(size=items)
    u = rng.integers(0, users, rows)
    i = rng.permutation(items)[_zipf(rng, rows, items, a=0.8)]  # popular items of any number, as in the real ids
    clicks = _clicks(rng, taste[u] + quality[i])
    times = 874724710 + np.sort(rng.integers(0, 18_000_000, rows))
    lines = [delimiter.join(MOVIELENS_COLUMNS)]
    for r in range(rows):
        user, item = u[r], i[r]
        fields = (
            str(user + 1),
            str(item + 1),
            str(user_age[user]),
            user_gender[user],
            user_job[user],
            user_zip[user],
            str(item_year[item]),
            item_genres[item],
            str(times[r]),
            str(clicks[r]),
        )
        lines.append(delimiter.join(fields))
    path.write_text("\n".join(lines) + "\n")
    return path
