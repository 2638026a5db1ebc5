"""persia_planner.modules: the half of persia-planner that executes plans (torch, fbgemm, torchrec).

* :mod:`.ps`: the embedding parameter servers of the plan's ``ps`` tier, on torch.distributed.rpc (store, sparse
  optimizers, sharding client, checkpoints, launcher).
* :mod:`.hybrid`: :class:`~persia_planner.modules.hybrid.HybridEmbeddingBagCollection`, a drop-in for TorchRec's
  ``EmbeddingBagCollection`` composing :mod:`.local` (the plan's local tables, sharded by TorchRec's
  ``DistributedModelParallel``, synchronous) and :mod:`.remote` (the PS tables, asynchronous with bounded staleness).
* :mod:`.distributed`: shards a model as its plan says and reads back what runs (``executed_plan``).
* :mod:`.train`: ``persia train``'s loop (local processes or torchrun); :mod:`.data`: synthetic and Criteo input.
* :mod:`.verify`: checks a hybrid run with staleness 0 against TorchRec (``EmbeddingBagCollection`` + DDP), step
  by step, losses and every table's rows.

Nothing here is imported by the planner core: each submodule imports torch itself, when it is used.
"""
