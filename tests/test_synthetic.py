"""The synthetic teacher's behaviour sequences (modules/data/synthetic.py, Interest): a history holds ids of the
candidate's feature, the click depends on their attention-pooled similarity, and leaving it out costs the teacher AUC;
a teacher without one draws exactly the data it always did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from persia_planner.errors import SpecError
from persia_planner.modules.data.synthetic import Interest, SyntheticClicks, Teacher, teacher_auc

FEATURES = ("user", "item", "history")


def _teacher(weight: float = 2.0) -> Teacher:
    interest = Interest("history", of="item", mean_length=12.0, weight=weight)
    return Teacher(features=FEATURES, rows={"user": 5000, "item": 2000, "history": 2000}, dim=8, num_dense=2,
                   interests=(interest,), seed=3)  # fmt: skip


def test_the_history_holds_the_candidates_ids_and_is_as_long_as_asked():
    teacher = _teacher()
    data = SyntheticClicks(teacher, batch_size=4096, num_batches=1, pooling={"history": 12.0}, seed=1)
    jt = data.batch(0).sparse.to_dict()
    history, items = jt["history"].values().numpy(), jt["item"].values().numpy()
    assert abs(jt["history"].lengths().float().mean().item() - 12.0) < 0.3
    # the history's ids are the item feature's ids (its hottest ones above all), not ids of a space of their own
    assert np.isin(history, teacher.ids_of_rank("item", np.arange(2000))).all()
    assert np.isin(items, history).mean() > 0.5
    assert teacher.ids_of("history") == "item" and teacher.ids_of("user") == "user"


def test_leaving_the_history_out_costs_the_teacher_auc():
    teacher = _teacher()
    data = SyntheticClicks(teacher, batch_size=8192, num_batches=4, pooling={"history": 12.0}, seed=2)
    batches = list(data)
    full = teacher_auc(batches)
    labels = torch.cat([b.labels for b in batches]).long()
    without = float(binary_auroc(torch.cat([teacher.prob(b, without=["history"]) for b in batches]), labels))
    assert full - without >= 0.02, (full, without)
    assert torch.allclose(teacher.prob(batches[0]), batches[0].teacher_prob)  # prob reads back what was drawn
    # with no weight the history changes nothing: the gap above is the interest term's alone
    weightless = _teacher(weight=0.0)
    assert torch.equal(weightless.prob(batches[0]), weightless.prob(batches[0], without=["history"]))


def test_a_teacher_without_interests_draws_the_same_data_as_before():
    # recorded from the teacher before interests existed: the default run's data must not move
    teacher = Teacher()
    assert teacher.scale == pytest.approx(0.3849523315027679, rel=1e-12)
    assert teacher.bias == pytest.approx(-2.272529374068103, rel=1e-12)
    batch = SyntheticClicks(teacher, batch_size=64, num_batches=1).batch(0)
    assert float(batch.teacher_prob.sum()) == pytest.approx(15.173988342285156, rel=1e-6)


def test_an_interest_must_name_a_sequence_of_another_pooled_feature():
    with pytest.raises(SpecError, match=r"interests\.history: must name a feature holding ids of another"):
        Teacher(features=FEATURES, interests=(Interest("history", of="history"),))
    with pytest.raises(SpecError, match=r"interests\.history: must name"):
        Teacher(features=FEATURES, interests=(Interest("history", of="nope"),))
