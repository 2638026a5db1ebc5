"""persia_planner.modules: the half of persia-planner that executes plans (torch, fbgemm, torchrec).

Planned in the next milestones: the embedding parameter servers (the ``ps`` tier, on torch.distributed.rpc) and
``HybridEmbeddingBagCollection`` with bounded-staleness hybrid training. Until then, GPU-resident plans run through
TorchRec's ``DistributedModelParallel`` with :func:`persia_planner.export.to_sharding_plan`.
"""
