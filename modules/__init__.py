"""persia_planner.modules: the half of persia-planner that executes plans (torch, fbgemm, torchrec).

* :mod:`.ps`: the embedding parameter servers of the plan's ``ps`` tier, on torch.distributed.rpc (store, sparse
  optimizers, sharding client, checkpoints, launcher).
* :mod:`persia_planner.modules.embedding.hybrid`:
  :class:`~persia_planner.modules.embedding.hybrid.HybridEmbeddingBagCollection`, a drop-in for TorchRec's
  ``EmbeddingBagCollection`` composing :mod:`persia_planner.modules.embedding.local` (the plan's local tables, sharded
  by TorchRec's ``DistributedModelParallel``, synchronous) and :mod:`persia_planner.modules.embedding.remote` (the PS
  tables, asynchronous with bounded staleness).
* :mod:`persia_planner.modules.embedding.model_parallel`: shards a model as its plan says and reads back what runs
(``executed_plan``).
* :mod:`.train`: ``persia train``'s loop (local processes or torchrun); :mod:`.data`: synthetic and Criteo input.
* :mod:`persia_planner.modules.tools.torchrec_equivalence`: checks a hybrid run with staleness 0 against TorchRec
  (``EmbeddingBagCollection`` + DDP), step by step, losses and every table's rows.

Nothing here is imported by the planner core: each submodule imports torch itself, when it is used.
"""
