"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_trainer():
    """A process group of one trainer (DMP needs one), torn down after the test."""
    import torch.distributed as dist  # here: most test modules never import torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
