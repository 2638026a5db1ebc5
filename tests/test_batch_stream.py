"""A trainer's data stream: where a resumed run is in its epochs, and the click metrics of an evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from persia_planner.modules.train.batch_stream import Epochs, click_metrics


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
