"""Training data: a Criteo-format reader, a Parquet / CSV click-log reader (pyarrow, mapped by model.yaml's
``data:``) and a synthetic click generator with a known teacher model.

All yield :class:`Batch` es (dense ``[B, D]`` float32, a KeyedJaggedTensor of int64 ids, float32 labels), so the
default run and the tests need no download while real Criteo Kaggle/Terabyte slices and click logs drop in unchanged.
The file readers share their sharding across trainers and DataLoader workers (:mod:`.shards`). :func:`as_batch`
takes TorchRec's ``Batch`` too.
"""

from __future__ import annotations

from persia_planner.modules.lazy_exports import lazy_exports

__all__ = [
    "FEATURE_NAMES",
    "Batch",
    "CriteoReader",
    "SyntheticClicks",
    "TabularReader",
    "Teacher",
    "as_batch",
    "as_batches",
    "hash_ids",
    "teacher_auc",
    "to_criteo",
    "write_criteo",
]

_HOMES = {
    "Batch": "persia_planner.modules.data.batch",
    "CriteoReader": "persia_planner.modules.data.criteo",
    "FEATURE_NAMES": "persia_planner.modules.data.criteo",
    "SyntheticClicks": "persia_planner.modules.data.synthetic",
    "TabularReader": "persia_planner.modules.data.tabular",
    "Teacher": "persia_planner.modules.data.synthetic",
    "as_batch": "persia_planner.modules.data.batch",
    "as_batches": "persia_planner.modules.data.batch",
    "hash_ids": "persia_planner.modules.data.ids",
    "teacher_auc": "persia_planner.modules.data.synthetic",
    "to_criteo": "persia_planner.modules.data.synthetic",
    "write_criteo": "persia_planner.modules.data.criteo_format",
}


__getattr__ = lazy_exports(__name__, _HOMES)
