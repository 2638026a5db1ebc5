"""Training data: a Criteo-format reader, a Parquet / CSV click-log reader (pyarrow, mapped by model.yaml's
``data:``) and a synthetic click generator with a known teacher model.

All yield :class:`Batch` es (dense ``[B, D]`` float32, a KeyedJaggedTensor of int64 ids, float32 labels), so the
default run and the tests need no download while real Criteo Kaggle/Terabyte slices and click logs drop in unchanged.
The file readers share their sharding across trainers and DataLoader workers (:mod:`.shards`). :func:`as_batch`
takes TorchRec's ``Batch`` too.
"""

from .batch import Batch, as_batch, as_batches
from .criteo import FEATURE_NAMES, CriteoReader
from .criteo_format import write_criteo
from .synthetic import SyntheticClicks, Teacher, teacher_auc, to_criteo
from .tabular import TabularReader, hash_ids

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
