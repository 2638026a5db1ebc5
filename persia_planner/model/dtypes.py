"""The dtypes of embedding weights and of what travels between processes (fp32, fp16, bf16)."""

from __future__ import annotations

import enum

from persia_planner.errors import ErrorKind, PlannerError, abbreviate

__all__ = ["DType"]


class DType(enum.StrEnum):
    """A dtype of embedding weights, of the parameter servers' wire or of the trainers' collectives."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def n_bytes(self) -> int:
        return 4 if self is DType.FP32 else 2

    @property
    def torch_name(self) -> str:
        """The name torch gives the dtype (``float16``), which ``persia train --ps-wire`` takes too."""
        return _TORCH_NAMES[self]

    @classmethod
    def parse(cls, text: str, option: str) -> DType:
        """``text`` as our name (``fp16``) or torch's (``float16``).

        Raises:
            PlannerError: Neither; the message names ``option`` and the choices.
        """
        for dtype in cls:
            if text in (dtype.value, dtype.torch_name):
                return dtype
        choices = ", ".join(f"{d.value} ({d.torch_name})" for d in cls)
        raise PlannerError(f"{option} must be one of {choices}, got {abbreviate(text, 30)}", kind=ErrorKind.INPUT)


_TORCH_NAMES = {DType.FP32: "float32", DType.FP16: "float16", DType.BF16: "bfloat16"}
