"""A trainer's data stream: where a resumed run is in its epochs, and an evaluation over every held-out sample."""

from __future__ import annotations

import math

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.modules.data.batch import Batch, blank_batch, padded
from persia_planner.modules.train.batch_stream import Epochs, click_metrics, evaluate, scoring_lockstep


def test_the_position_of_a_step_counts_the_finished_epochs():
    epochs = Epochs([5, 3])
    assert [epochs.position(s) for s in (0, 4, 5, 7, 8, 11)] == [(0, 0), (0, 4), (1, 0), (1, 2), (2, 0), (2, 3)]
    assert Epochs().position(6) == (0, 6)  # a checkpoint from before epochs: its steps into the first


def test_normalized_entropy_and_calibration():
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # Predicting the observed rate for every sample: normalized entropy 1, calibrated.
    base = click_metrics(torch.full((4,), 0.25), y)
    assert base["normalized_entropy"] == pytest.approx(1.0) and base["calibration"] == pytest.approx(1.0)
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert base["eval_loss"] == pytest.approx(entropy) and base["eval_ctr"] == 0.25 and base["eval_samples"] == 4
    better = click_metrics(torch.tensor([0.9, 0.1, 0.1, 0.1]), y)
    assert better["normalized_entropy"] == pytest.approx(-math.log(0.9) / entropy)
    assert better["calibration"] == pytest.approx(0.3 / 0.25)
    # One class only: no entropy to normalize by; no click to calibrate against.
    none = click_metrics(torch.tensor([0.2, 0.3]), torch.zeros(2))
    assert none["normalized_entropy"] is None and none["calibration"] is None


def test_an_epoch_ends_at_the_sum_of_the_lengths_before_it():
    epochs = Epochs([5, 3])
    assert [s for s in range(12) if epochs.ends_at(s)] == [5, 8]
    assert not Epochs([0]).ends_at(0)  # an epoch with no batch ends at no step


def _batch(n: int, first_id: int = 0) -> Batch:
    ids = torch.arange(first_id, first_id + n)
    sparse = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.cat([ids, ids]), lengths=torch.ones(2 * n, dtype=torch.int32)
    )
    return Batch(dense=torch.ones(n, 3), sparse=sparse, labels=(ids % 2).float())


def test_a_partial_batch_is_padded_with_blank_masked_samples():
    batch = padded(_batch(3, first_id=10), 5)
    assert batch.size == 5 and batch.mask.tolist() == [True, True, True, False, False]
    # Key-major lengths: each key's bags of the 3 samples, then 2 empty bags; the ids are unchanged.
    assert batch.sparse.lengths().tolist() == [1, 1, 1, 0, 0] * 2
    assert batch.sparse.values().tolist() == [10, 11, 12] * 2
    assert batch.sparse["b"].lengths().tolist() == [1, 1, 1, 0, 0]
    assert batch.dense[3:].abs().sum() == 0 and batch.labels.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    full = _batch(5)
    assert padded(full, 5) is full
    with pytest.raises(ValueError, match="6 samples does not fit 5"):
        padded(_batch(6), 5)
    blank = blank_batch(["a", "b"], 3, 4)
    assert blank.size == 4 and not blank.mask.any() and blank.sparse.values().numel() == 0


def test_one_trainer_scores_every_sample_of_its_batches_at_one_size():
    out = list(scoring_lockstep([_batch(4), _batch(4, 4), _batch(2, 8)]))
    assert [b.size for b in out] == [4, 4, 4]
    assert sum(int(b.mask.sum()) if b.mask is not None else b.size for b in out) == 10
    assert list(scoring_lockstep([])) == []


def test_an_evaluation_leaves_the_padding_out_of_the_metrics():
    class Scores(torch.nn.Module):
        """Scores a sample by its first id: the padding, with no id, would score 0.5."""

        def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
            pooled = torch.zeros(dense.shape[0])
            a = sparse["a"]
            pooled.index_add_(0, torch.repeat_interleave(torch.arange(dense.shape[0]), a.lengths()), a.values().float())
            return (pooled - 4.5).unsqueeze(-1)

    result = evaluate(Scores(), [_batch(4), _batch(4, 4), _batch(2, 8)])
    labels = (torch.arange(10) % 2).float()
    expected = click_metrics(torch.sigmoid(torch.arange(10).float() - 4.5), labels)
    assert result["eval_samples"] == 10 and result["eval_loss"] == pytest.approx(expected["eval_loss"])


def test_blank_batches_of_a_weighted_collection_carry_empty_weights():
    assert blank_batch(["a"], 1, 3, weighted=True).sparse.weights().numel() == 0
    assert blank_batch(["a"], 1, 3).sparse.weights_or_none() is None
