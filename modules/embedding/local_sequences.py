"""The plan's local sequence tables: a TorchRec ``EmbeddingCollection`` that ``DistributedModelParallel`` shards.

:class:`LocalEmbeddings` is the synchronous half of :class:`~.sequence_hybrid.HybridEmbeddingCollection`, as
:class:`~.local.LocalEmbeddingBags` is of the bag collection: the same ids mapped into the tables
(``id mod num_embeddings``), seeded initialisation, weights and optimizer state read and written as pieces under
TorchRec's keys (``embeddings.<table>.weight``), and the same report of what runs. Only the collection differs:
an ``EmbeddingCollection`` (attribute ``ec``), whose output is one row per id, as a ``JaggedTensor`` per feature,
sharded by TorchRec's ``EmbeddingCollectionSharder`` (table-wise, row-wise, column-wise, data-parallel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from persia_planner.modules.embedding.local import LocalEmbeddingBags

__all__ = ["LocalEmbeddings"]


class LocalEmbeddings(LocalEmbeddingBags):
    """The local sequence tables of a plan, in a TorchRec ``EmbeddingCollection`` (``ec``) that DMP shards.

    Args:
        tables: The local tables' configs (one ``embedding_dim`` for all, as TorchRec's collection requires;
            multiples of 4 for fbgemm).
        device: Where the unsharded collection is built; ``meta`` defers the allocation to DMP's shards.
        seed: Seed of the initial weights, uniform in ``+-sqrt(1 / num_embeddings)`` as TorchRec's default.
    """

    COLLECTION: ClassVar[str] = "ec"
    KEY_PREFIX: ClassVar[str] = "embeddings"

    def __init__(self, tables: Sequence[EmbeddingConfig], *, device: torch.device | None = None, seed: int = 0) -> None:
        super().__init__(tables, is_weighted=False, device=device, seed=seed)  # type: ignore[arg-type]

    def build_collection(self, device: torch.device) -> nn.Module:
        """The unsharded ``EmbeddingCollection`` of :attr:`configs` on ``device``."""
        return EmbeddingCollection(tables=self.configs, device=device)  # type: ignore[arg-type]

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:  # type: ignore[override]
        """One row per id of the local features of ``features`` (a KJT holding at least those keys), by feature.

        Returns:
            TorchRec's ``Dict[str, JaggedTensor]``: per feature, ``[ids, dim]`` values and the samples' lengths.
        """
        if torch.jit.is_scripting():  # unsharded: TorchRec's collection, checks and all
            return self.ec(self.to_range(features))
        if is_fx_symbolic_tracing():  # the sharded module's awaitable is the tracer's to resolve
            return self.ec(self.to_range(features))
        return self._forward_eager(features)

    @torch.jit.unused
    def _forward_eager(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:  # type: ignore[override]
        out = self.ec(self.to_range(features))
        return out.wait() if hasattr(out, "wait") else out  # the sharded module answers with an awaitable


# fx writes a traced graph's signature from forward's annotations (see local.py).
LocalEmbeddings.forward.__annotations__.update(features=KeyedJaggedTensor, **{"return": dict[str, JaggedTensor]})
