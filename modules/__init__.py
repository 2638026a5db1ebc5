"""persia_planner.modules: the half of persia-planner that executes plans (torch, fbgemm, torchrec).

* :mod:`.embedding`: :class:`~persia_planner.modules.embedding.hybrid.HybridEmbeddingBagCollection`, a drop-in for
  TorchRec's ``EmbeddingBagCollection`` whose local tables TorchRec's ``DistributedModelParallel`` shards
  (synchronous) and whose PS tables train asynchronously with bounded staleness; ``model_parallel`` shards a model
  as its plan says and reads back what runs.
* :mod:`.ps`: the embedding parameter servers of the plan's ``ps`` tier, on torch.distributed.rpc (store, sparse
  optimizers, sharding client, checkpoints); :mod:`.launcher`: the job's processes (servers and trainers started,
  their rendezvous and lifecycle).
* :mod:`.train`: ``persia train`` (local processes or torchrun); :mod:`.data`: synthetic, Criteo, Parquet and CSV
  input.
* :mod:`.tools`: calibration, measured tuning, the K = 0 check against TorchRec and the memory audit.

Nothing here is imported by the planner core: each submodule imports torch itself, when it is used.

The public surface is ``__all__`` below (importable from here, each loaded when first used) and each subpackage's
own ``__all__``. A module that moves keeps its old import path: :data:`.moved_modules.MOVED` maps it to its new
home, and importing it warns with that home.
"""

from __future__ import annotations

from persia_planner.modules import moved_modules
from persia_planner.modules.lazy_exports import lazy_exports

# The public surface: these names, importable from here, and each subpackage's own __all__. Modules that moved keep
# their old import paths (moved_modules.MOVED).
__all__ = [
    "CriteoReader",
    "HybridEmbeddingBagCollection",
    "HybridEmbeddingBagCollectionSharder",
    "PsClient",
    "SparseOptimizer",
    "SyntheticClicks",
    "TabularReader",
    "Teacher",
    "TrainConfig",
    "build_model",
    "distribute",
    "local_cluster",
    "run_trainers",
    "train_local",
    "train_torchrun",
]

_HOMES = {
    "CriteoReader": "persia_planner.modules.data.criteo",
    "HybridEmbeddingBagCollection": "persia_planner.modules.embedding.hybrid",
    "HybridEmbeddingBagCollectionSharder": "persia_planner.modules.embedding.sharder",
    "PsClient": "persia_planner.modules.ps.client",
    "SparseOptimizer": "persia_planner.modules.embedding.sparse_optimizer",
    "SyntheticClicks": "persia_planner.modules.data.synthetic",
    "TabularReader": "persia_planner.modules.data.tabular",
    "Teacher": "persia_planner.modules.data.synthetic",
    "TrainConfig": "persia_planner.modules.train.config",
    "build_model": "persia_planner.modules.train.loop",
    "distribute": "persia_planner.modules.embedding.model_parallel",
    "local_cluster": "persia_planner.modules.launcher.launch",
    "run_trainers": "persia_planner.modules.train.engine",
    "train_local": "persia_planner.modules.train.engine",
    "train_torchrun": "persia_planner.modules.train.engine",
}

moved_modules.install()
__getattr__ = lazy_exports(__name__, _HOMES)
