"""DIN, the Deep Interest Network (Zhou et al., KDD 2018): target attention of a sample over its behaviour sequences,
the dense arch ``persia train`` builds for ``dense: {arch: din}`` (TorchRec has none).

Beside the pooled features (a bag collection, as DLRM's), each sequence feature's rows come from an
``EmbeddingCollection`` (one row per id). A query made from the sample's dense and pooled embeddings scores each id
of a sequence with DIN's activation unit over ``[q, k, q - k, q * k]``; the scores, softmaxed over the sample's ids
(an empty sequence attends to nothing; one longer than its table's ``max`` attends over its last ``max`` ids, the
most recent), weight the rows into one vector per sequence; the over arch reads the dense
embedding, the pooled ones and the attended ones. Its sizes are those
:meth:`persia_planner.model.dense.DenseArch.counts` prices, so the plan and the run describe one network.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from persia_planner.model.dense import ArchKind, DenseArch

__all__ = ["DIN", "attend", "last_ids", "mlp"]


def mlp(widths: Sequence[int], dropout: float = 0.0, last_relu: bool = True) -> nn.Sequential:
    """Linear layers through ``widths``, each followed by a ReLU (not the last one unless ``last_relu``) and, on
    hidden layers, dropout ``p``."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(fan_in, fan_out))
        last = i == len(widths) - 2
        if not last or last_relu:
            layers.append(nn.ReLU())
        if not last and dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def last_ids(rows: JaggedTensor, most: int) -> JaggedTensor:
    """Each sample's last ``most`` rows of ``rows`` (a sequence's most recent ids): the same rows where none is
    longer."""
    lengths = rows.lengths()
    if not lengths.numel() or int(lengths.max()) <= most:
        return rows
    ends = torch.cumsum(lengths, 0)
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    from_end = ends[sample] - 1 - torch.arange(int(ends[-1]), device=lengths.device)
    return JaggedTensor(values=rows.values()[from_end < most], lengths=lengths.clamp(max=most))


def attend(query: torch.Tensor, rows: JaggedTensor, unit: nn.Module) -> torch.Tensor:
    """DIN's attention of each sample's ``query [B, dim]`` over its sequence's ``rows`` (a ``JaggedTensor`` of
    ``[ids, dim]``): the activation ``unit`` scores each id from ``[q, k, q - k, q * k]``, softmaxed over the sample's
    ids; returns the weighted sums ``[B, dim]`` (zeros for an empty sequence)."""
    lengths = rows.lengths()
    longest = int(lengths.max()) if lengths.numel() else 0
    keys = rows.to_padded_dense(desired_length=longest)  # [B, L, dim]
    mask = torch.arange(longest, device=keys.device)[None, :] < lengths[:, None]
    q = query[:, None, :].expand_as(keys)
    scores = unit(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)  # [B, L]
    weights = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=1) * mask
    return (weights[..., None] * keys).sum(dim=1)


class DIN(nn.Module):
    """DIN over a bag collection of pooled features and a sequence collection (see the module docstring).

    Called as TorchRec's ``DLRM``: ``model(dense_features [B, num_dense], sparse_features KJT)`` returns the logits
    ``[B, 1]``.

    Args:
        embedding_bag_collection: The pooled features' collection (a ``KeyedTensor`` out, read by key); None: the
            model has no pooled feature.
        embedding_collection: The sequence features' collection (``Dict[str, JaggedTensor]`` out).
        arch: The dense arch (``din``): bottom MLP, activation unit sizes, over arch, dropout.
        dim: The tables' one embedding dim.
        pooled_keys: The pooled features' output keys, in the query's order.
        sequence_keys: The sequence features' output keys.
        longest: Per sequence key, the most ids it attends over (its table's ``max`` sequence length: a longer
            sequence is read by its last ids, the most recent); a key left out reads every id.
        candidates: Per sequence key, the output key of its candidate's row in the same table (the sample's item
            looked up in its history's table): that row is the sequence's query, DIN's target attention. A key left
            out attends from the query learned from the dense and pooled embeddings.

    Raises:
        ValueError: An arch other than ``din``, or no sequence feature.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module | None,
        embedding_collection: nn.Module,
        arch: DenseArch,
        dim: int,
        pooled_keys: Sequence[str],
        sequence_keys: Sequence[str],
        longest: Mapping[str, int] | None = None,
        candidates: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if arch.kind is not ArchKind.DIN or not sequence_keys:
            raise ValueError("DIN needs 'arch: din' and at least one sequence feature")
        self.embedding_bag_collection = embedding_bag_collection
        self.embedding_collection = embedding_collection
        self.pooled_keys, self.sequence_keys = list(pooled_keys), list(sequence_keys)
        self.longest = dict(longest or {})
        self.candidates = dict(candidates or {})
        vectors = len(self.pooled_keys) + 1
        self.dense_arch = mlp((arch.num_dense, *arch.bottom, dim), arch.dropout)
        # The learned query, where a sequence has no candidate to attend from (no parameter left unused otherwise).
        learned = any(key not in self.candidates for key in self.sequence_keys)
        self.query = nn.Linear(vectors * dim, dim) if learned else None
        self.units = nn.ModuleDict(
            {key: mlp((4 * dim, *arch.attention, 1), last_relu=False) for key in self.sequence_keys}
        )
        width = (vectors + len(self.sequence_keys)) * dim
        self.over_arch = mlp((width, *arch.over), arch.dropout, last_relu=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        dense = self.dense_arch(dense_features)
        vectors = [dense]
        if self.embedding_bag_collection is not None:
            pooled = self.embedding_bag_collection(sparse_features).to_dict()
            vectors += [pooled[key] for key in self.pooled_keys]
        learned = self.query(torch.cat(vectors, dim=1)) if self.query is not None else None
        sequences = self.embedding_collection(sparse_features)
        attended = []
        for key in self.sequence_keys:
            rows = sequences[key]
            if key in self.longest:
                rows = last_ids(rows, self.longest[key])
            if key in self.candidates:  # the sample's candidate row (its first id; none: zeros)
                query = sequences[self.candidates[key]].to_padded_dense(desired_length=1)[:, 0, :]
            else:
                assert learned is not None
                query = learned
            attended.append(attend(query, rows, self.units[key]))
        return self.over_arch(torch.cat(vectors + attended, dim=1))
