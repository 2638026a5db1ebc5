"""TorchRec's train pipeline with the parameter-server tables inside it.

:class:`HybridTrainPipeline` is TorchRec's ``TrainPipelineSparseDist``: while batch ``i`` runs forward and backward,
batch ``i + 1``'s ids travel to their shards (the local tables' input all-to-all) and batch ``i + 2`` is read and
copied to the device. It pipelines the collection's local tables (their id mapping, ``IdsInRange``, is a postproc
module TorchRec runs ahead with the input all-to-all) and, for the PS tables, asks the servers for the rows of every
batch it stages as soon as the staleness bound allows: with ``K >= 1`` batch ``i + 1``'s rows travel during batch
``i``'s step, batch ``i + 2``'s too with ``K >= 2``. ``K = 0`` with several trainers keeps its one gathered update
per step (the request is a collective, made at the batch's own forward).

:class:`PipelineStep` is the model as the pipeline calls it (one batch in, the loss and its outputs out);
:class:`PipelinedTrainLoop` runs it with :class:`.loop.TrainLoop`'s interface.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torchrec.datasets.utils import Batch as TorchRecBatch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from persia_planner.modules.data.batch import as_batches
from persia_planner.modules.embedding.hybrid_set import TrainedTables
from persia_planner.modules.step_breakdown import PS_PUSH, PS_WAIT
from persia_planner.modules.train.loop import StepStats

__all__ = ["HybridTrainPipeline", "PipelineStep", "PipelinedTrainLoop"]


class PipelineStep(nn.Module):
    """A model ``model(dense, sparse) -> logits`` as TorchRec's pipeline calls it: ``step(batch)`` returns the
    binary cross-entropy loss and ``(loss, logits, labels)`` (TorchRec's ``DLRMTrain`` contract). Shard this module
    with ``DistributedModelParallel`` (``distribute``), not the model inside."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: TorchRecBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


class HybridTrainPipeline(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` that also stages the PS rows of the batches it holds.

    Args:
        model: ``DistributedModelParallel`` over a :class:`PipelineStep`.
        optimizer: The dense optimizer (and the data-parallel replicas'), as for TorchRec's pipeline.
        device: The trainer's device.
        hybrid: The model's collection (its PS tables' prefetch and staleness bound).
    """

    def __init__(self, model: nn.Module, optimizer: Any, device: torch.device, hybrid: TrainedTables) -> None:
        self._hybrid = hybrid
        # Staged batches whose PS rows are not requested yet, oldest first: requests go out in batch order.
        self._unsent: collections.deque[TorchRecBatch] = collections.deque()
        super().__init__(model, optimizer, device, pipeline_postproc=True, custom_model_fwd=self._forward)

    @property
    def pipelined(self) -> dict[str, list[str]]:
        """What TorchRec pipelines: its sharded modules (their input all-to-all runs a step ahead) and the postproc
        modules it runs ahead with them, by type name."""
        return {
            "sharded": [type(m).__name__ for m in self._pipelined_modules],
            "postproc": [type(m.postproc_module).__name__ for m in self._pipelined_postprocs],
        }

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        if not super().enqueue_batch(dataloader_iter):
            return False
        self._unsent.append(self.batches[-1])
        if self._hybrid.max_staleness > 0:  # K = 0: a collective, at the batch's own forward
            self._send(wait_for_first=False)
        return True

    def _send(self, *, wait_for_first: bool) -> None:
        """Request the rows of the staged batches, in order, while the staleness bound allows it (the first may
        wait)."""
        block = wait_for_first
        while self._unsent:
            if not self._hybrid.prefetch(self._unsent[0].sparse_features, block=block):
                return
            self._unsent.popleft()
            if self._hybrid.max_staleness == 0:  # the next batch's rows wait for this one's update
                return
            block = False

    def _forward(self, batch: TorchRecBatch) -> Any:
        if self._unsent and self._unsent[0] is batch:  # its rows were not sent ahead: they are now, waiting
            self._send(wait_for_first=True)
        return self._model(batch)


class PipelinedTrainLoop:
    """:class:`.loop.TrainLoop`'s interface over :class:`HybridTrainPipeline`: ``run(batches)`` trains on each and
    yields a :class:`.loop.StepStats` per step (the data's reading is part of the step: the pipeline overlaps it).

    Args:
        model: ``DistributedModelParallel`` over a :class:`PipelineStep`.
        hybrid: Its collection.
        optimizer: The dense optimizer (:func:`.loop.make_optimizer`).
        device: The trainer's device (default CPU).
    """

    def __init__(
        self, model: nn.Module, hybrid: TrainedTables, optimizer: Any, device: torch.device | None = None
    ) -> None:
        self.model, self.hybrid, self.optimizer = model, hybrid, optimizer
        self.device = device or torch.device("cpu")
        self.pipeline: HybridTrainPipeline | None = None  # the last run's

    def scoring_model(self) -> nn.Module:
        """The model to evaluate with between steps, ``model(dense, sparse) -> logits``: the pipeline is detached
        (TorchRec's pipelined forwards restored), and attaches again at its next step."""
        if self.pipeline is not None:
            self.pipeline.detach()
        return self.model.module.model  # DistributedModelParallel -> PipelineStep -> the model, sharded in place

    def run(self, batches: Iterable[Any]) -> Iterator[StepStats]:
        """Train on every batch of ``batches`` (ours or TorchRec's ``Batch`` es)."""
        stream = (TorchRecBatch(b.dense, b.sparse, b.labels) for b in as_batches(batches))
        pipeline = self.pipeline = HybridTrainPipeline(self.model, self.optimizer, self.device, self.hybrid)
        self.model.train()
        while True:
            start = time.perf_counter()
            before = self.hybrid.ps_time_ms()
            try:
                loss, _, labels = pipeline.progress(stream)
            except StopIteration:
                return
            after = self.hybrid.ps_time_ms()
            spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (PS_WAIT, PS_PUSH)}
            yield StepStats(
                float(loss),
                (time.perf_counter() - start) * 1e3,
                self.hybrid.staleness,
                int(labels.numel()),
                0.0,
                spent[PS_WAIT],
                spent[PS_PUSH],
            )
