"""persia_planner.modules: the half of persia-planner that executes plans (torch, fbgemm, torchrec).

* :mod:`.ps`: the embedding parameter servers of the plan's ``ps`` tier, on torch.distributed.rpc (store, sparse
  optimizers, sharding client, checkpoints, launcher).
* :mod:`.hybrid`: :class:`~persia_planner.modules.hybrid.HybridEmbeddingBagCollection`, a drop-in for TorchRec's
  ``EmbeddingBagCollection`` whose PS tables train asynchronously with bounded staleness while the rest trains
  synchronously (fbgemm kernels for local tables, DDP for the dense network).
* :mod:`.train`: ``persia train``'s loop (local processes or torchrun); :mod:`.data`: synthetic and Criteo input.
* :mod:`.verify`: checks a hybrid run with staleness 0 against TorchRec (``EmbeddingBagCollection`` + DDP), step
  by step. Plans without a ``ps`` tier run in TorchRec's ``DistributedModelParallel`` through
  :func:`persia_planner.export.to_sharding_plan`.

Nothing here is imported by the planner core: each submodule imports torch itself, when it is used.
"""
