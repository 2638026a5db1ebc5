"""The torch dtype of each :class:`~persia_planner.model.dtypes.DType`: what PS rows and gradients travel in
(``persia train --ps-wire``, a field of the PS protocol), as the runtime hands it to torch.

The planner's one dtype vocabulary (``fp16`` and torch's ``float16`` alike, :meth:`.DType.parse`) is checked
without torch; this module is the runtime's half of it, and imports torch only when asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from persia_planner.model.dtypes import DType

if TYPE_CHECKING:
    import torch

__all__ = ["torch_dtype"]


def torch_dtype(dtype: DType) -> torch.dtype:
    """``dtype`` as torch's (``DType.FP16`` is ``torch.float16``)."""
    import torch  # here, not at the top: the CLI validates options without torch

    return getattr(torch, dtype.torch_name)
