"""The dtypes the PS rows and gradients travel in: an option of ``persia train`` and a field of the PS protocol.

Torch-free, so that the CLI checks the option without importing torch.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["WireDtype"]


class WireDtype(enum.StrEnum):
    """The dtype PS rows and gradients travel in (the servers keep the rows in the table's dtype)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: the CLI validates options without torch

        return getattr(torch, self.value)
