"""persia_planner.modules: the half of persia-planner that executes plans (torch, fbgemm, torchrec).

* :mod:`.embedding`: :class:`~persia_planner.modules.embedding.hybrid.HybridEmbeddingBagCollection`, a drop-in for
  TorchRec's ``EmbeddingBagCollection`` whose local tables TorchRec's ``DistributedModelParallel`` shards
  (synchronous) and whose PS tables train asynchronously with bounded staleness; ``model_parallel`` shards a model
  as its plan says and reads back what runs.
* :mod:`.ps`: the embedding parameter servers of the plan's ``ps`` tier, on torch.distributed.rpc (store, sparse
  optimizers, sharding client, checkpoints, launcher).
* :mod:`.train`: ``persia train`` (local processes or torchrun); :mod:`.data`: synthetic, Criteo, Parquet and CSV
  input.
* :mod:`.tools`: calibration, measured tuning, the K = 0 check against TorchRec and the memory audit.

Nothing here is imported by the planner core: each submodule imports torch itself, when it is used.
"""
