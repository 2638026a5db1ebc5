"""Training data: a Criteo-format reader and a synthetic click generator with a known teacher model.

Both yield :class:`Batch` es (dense ``[B, 13]`` float32, a KeyedJaggedTensor of int64 ids, float32 labels), so the
default run and the tests need no download while real Criteo Kaggle/Terabyte slices drop in unchanged.
"""

from .criteo import FEATURE_NAMES, Batch, CriteoReader
from .criteo_format import write_criteo
from .synthetic import SyntheticClicks, Teacher, teacher_auc, to_criteo

__all__ = [
    "FEATURE_NAMES",
    "Batch",
    "CriteoReader",
    "SyntheticClicks",
    "Teacher",
    "teacher_auc",
    "to_criteo",
    "write_criteo",
]
